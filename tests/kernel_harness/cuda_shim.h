// Enough CUDA to compile the source that mx.fast.cuda_kernel generates as
// C++20 on the CPU (reached through cuda_include/, which stands in for MLX's
// utils.cuh and <cooperative_groups.h>). Warps are the runtime's simdgroups.
#pragma once

#include <array>
#include <bit>
#include <cmath>

#include "shim_runtime.h"

struct uint3 {
  unsigned x = 0, y = 0, z = 0;
};
typedef uint3 dim3;
typedef _Float16 __half;
typedef shim::bf16 __nv_bfloat16;

namespace cuda_shim {
inline uint3 u3(const shim::Dim3& d) { return uint3{d.x, d.y, d.z}; }
}  // namespace cuda_shim

#define threadIdx (::cuda_shim::u3(::shim::ctx().local_pos))
#define blockIdx (::cuda_shim::u3(::shim::ctx().group_pos))
#define blockDim (::cuda_shim::u3(::shim::ctx().group_threads))
#define gridDim (::cuda_shim::u3(::shim::ctx().groups))
#define warpSize 32

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __grid_constant__
#define __shared__ static

using ShimSrcLoc = std::source_location;

inline void __syncthreads(const ShimSrcLoc& loc = ShimSrcLoc::current()) {
  shim::group_barrier("__syncthreads", loc);
}
inline void __syncwarp(unsigned = 0xffffffffu, const ShimSrcLoc& loc = ShimSrcLoc::current()) {
  shim::simd_sync("__syncwarp", loc);
}

// Full-warp masks only: a partial mask is the divergent use we want to flag.
inline void shim_check_mask(unsigned mask) {
  if (mask != 0xffffffffu) shim::fail(shim::kExitUsage, "partial warp mask %#x", mask);
}
template <typename T>
T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32,
                  const ShimSrcLoc& loc = ShimSrcLoc::current()) {
  shim_check_mask(mask);
  return shim::simd_exchange(v, "__shfl_xor_sync", loc, [=](auto slot, int n, int lane) {
    const int src = (lane & ~(width - 1)) | ((lane % width) ^ lane_mask);
    return src < n ? slot(src) : slot(lane);
  });
}
template <typename T>
T __shfl_sync(unsigned mask, T v, int src_lane, int width = 32,
              const ShimSrcLoc& loc = ShimSrcLoc::current()) {
  shim_check_mask(mask);
  return shim::simd_exchange(v, "__shfl_sync", loc, [=](auto slot, int, int lane) {
    return slot((lane & ~(width - 1)) + src_lane % width);
  });
}
template <typename T>
T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32,
                   const ShimSrcLoc& loc = ShimSrcLoc::current()) {
  shim_check_mask(mask);
  return shim::simd_exchange(v, "__shfl_down_sync", loc, [=](auto slot, int n, int lane) {
    const int src = lane + int(delta);
    return (src % width) >= int(delta) && src < n ? slot(src) : slot(lane);
  });
}

inline float __half2float(__half h) { return float(h); }
inline __half __float2half(float f) { return __half(f); }
inline __half __float2half_rn(float f) { return __half(f); }
inline float __bfloat162float(__nv_bfloat16 b) { return float(b); }
inline __nv_bfloat16 __float2bfloat16(float f) { return __nv_bfloat16(f); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16(f); }
inline float __expf(float x) { return std::exp(x); }
inline float __int_as_float(int x) { return std::bit_cast<float>(x); }
// expf comes from <cmath> (global namespace).

namespace cuda::std {
using ::std::array;
}  // namespace cuda::std

// Threadgroup (shared) arrays, checked as in msl_shim.h; SHIM_REAL_TG_ARRAY
// compiles cuda_backend.h's `__shared__ T name[N]` instead.
#ifndef SHIM_REAL_TG_ARRAY
#define TG_ARRAY(type, name, count) static ::shim::TgArray<type, (count)> name(#name)
#endif
