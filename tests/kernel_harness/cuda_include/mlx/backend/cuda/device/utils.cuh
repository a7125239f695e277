// Emulator stand-in for MLX's utils.cuh: the CPU shim plus the Shape/Strides
// types that generated custom-kernel signatures use.
#pragma once

#include <cstdint>

#include "cuda_shim.h"

#define MAX_NDIM 10

namespace mlx::core::cu {
using Shape = cuda::std::array<int32_t, MAX_NDIM>;
using Strides = cuda::std::array<int64_t, MAX_NDIM>;
}  // namespace mlx::core::cu
