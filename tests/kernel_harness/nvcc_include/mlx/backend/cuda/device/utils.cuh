// Minimal stand-in for MLX's utils.cuh for a real nvcc compile check: the
// includes and types a generated custom-kernel signature relies on.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda/std/array>

#define MAX_NDIM 10

namespace mlx::core::cu {
using Shape = cuda::std::array<int32_t, MAX_NDIM>;
using Strides = cuda::std::array<int64_t, MAX_NDIM>;
}  // namespace mlx::core::cu
