// Metal backend for the kvchat kernels (MLX prepends <metal_stdlib> and
// `using namespace metal;`). Guards let the Linux emulator pre-define TG_ARRAY.
#ifndef KVCHAT_METAL_BACKEND_H
#define KVCHAT_METAL_BACKEND_H

#define PA_FN inline

// Threadgroup arrays are declared through one macro so CUDA and the emulator
// can map them to __shared__ / static storage.
#ifndef TG_ARRAY
#define TG_ARRAY(type, name, count) threadgroup type name[count]
#endif

PA_FN float pa_exp(float x) {
  return metal::exp(x);
}

// A quiet NaN: a kernel's answer for a call it cannot read (a bad block id).
PA_FN float pa_nan() {
  return as_type<float>(0x7fc00000u);
}

template <typename U>
PA_FN float pa_to_float(U x) {
  return static_cast<float>(x);
}

template <typename U>
PA_FN U pa_from_float(float x) {
  return static_cast<U>(x);
}

#endif  // KVCHAT_METAL_BACKEND_H
