// CUDA backend for the kvchat kernels: maps the Metal builtins used by the
// shared bodies onto CUDA (mx.fast.cuda_kernel injects no thread attributes
// and compiles with NVRTC after including cuda_fp16.h / cuda_bf16.h).
#ifndef KVCHAT_CUDA_BACKEND_H
#define KVCHAT_CUDA_BACKEND_H

#define PA_FN __device__ __forceinline__

#ifndef TG_ARRAY
#define TG_ARRAY(type, name, count) __shared__ type name[count]
#endif

// Metal thread attributes over CUDA built-ins (1-D threadgroups only).
#define thread_index_in_simdgroup (threadIdx.x % 32u)
#define simdgroup_index_in_threadgroup (threadIdx.x / 32u)
#define thread_index_in_threadgroup (threadIdx.x)
#define thread_position_in_threadgroup (threadIdx)
#define threadgroup_position_in_grid (blockIdx)

namespace mem_flags {
enum : int { mem_none = 0, mem_device = 1, mem_threadgroup = 2 };
}  // namespace mem_flags

PA_FN void threadgroup_barrier(int) {
  __syncthreads();
}

PA_FN void simdgroup_barrier(int) {
  __syncwarp();
}

// Butterfly reduction: every lane ends with the full sum, as Metal's simd_sum.
PA_FN float simd_sum(float x) {
  for (int offset = 16; offset > 0; offset /= 2) {
    x += __shfl_xor_sync(0xffffffffu, x, offset);
  }
  return x;
}

PA_FN float simd_max(float x) {
  for (int offset = 16; offset > 0; offset /= 2) {
    const float y = __shfl_xor_sync(0xffffffffu, x, offset);
    x = x > y ? x : y;
  }
  return x;
}

// Precise expf: fp32 results must match the reference to 1e-5.
PA_FN float pa_exp(float x) {
  return expf(x);
}

// A quiet NaN: a kernel's answer for a call it cannot read (a bad block id).
PA_FN float pa_nan() {
  return __int_as_float(0x7fc00000);
}

PA_FN float pa_to_float(float x) {
  return x;
}
PA_FN float pa_to_float(__half x) {
  return __half2float(x);
}
PA_FN float pa_to_float(__nv_bfloat16 x) {
  return __bfloat162float(x);
}

template <typename U>
struct PaFromFloat;
template <>
struct PaFromFloat<float> {
  static PA_FN float cast(float x) { return x; }
};
template <>
struct PaFromFloat<__half> {
  static PA_FN __half cast(float x) { return __float2half_rn(x); }
};
template <>
struct PaFromFloat<__nv_bfloat16> {
  static PA_FN __nv_bfloat16 cast(float x) { return __float2bfloat16_rn(x); }
};

template <typename U>
PA_FN U pa_from_float(float x) {
  return PaFromFloat<U>::cast(x);
}

#endif  // KVCHAT_CUDA_BACKEND_H
