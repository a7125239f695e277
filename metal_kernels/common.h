// Backend-neutral helpers for the kvchat kernels. Placed after metal_backend.h
// or cuda_backend.h, which provide PA_FN, pa_exp, pa_to_float, pa_from_float,
// TG_ARRAY and the Metal builtins the kernel bodies use.
#ifndef KVCHAT_COMMON_H
#define KVCHAT_COMMON_H

// Lanes per simdgroup (Metal) or warp (CUDA): 32 on every supported GPU.
#define PA_SIMD_WIDTH 32

// Online softmax starts from a finite minimum so no -inf arithmetic can
// produce NaN (exp(-inf - -inf)) whatever the fast-math mode.
#define PA_FINITE_MIN (-3.4028234663852886e+38f)

PA_FN float pa_max(float a, float b) {
  return a > b ? a : b;
}

#endif  // KVCHAT_COMMON_H
