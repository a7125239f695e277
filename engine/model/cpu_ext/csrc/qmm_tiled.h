// The int16-activation (AVX-512 VNNI) quantized matmul over 4/8-bit weights in kvchat's
// tiled layout (qmm_tiled.cpp; the layout is ops.py's `tile`).
#pragma once

#include <cstdint>

#include "quant.h"

namespace kvchat {

// How the tiled kernels quantize x: 16 (int16 per group, the default: ~f16 precision) or
// 8 (int8 per group, llama.cpp's Q8_0 way: twice the multiply rate, some perplexity).
// Process-wide; read when a product runs.
void set_activation_bits(int bits);
int activation_bits();

// Whether this build has the tiled path (compiled with AVX-512 VNNI).
bool tiled_supported();

// y (M x N) = x (M x K) @ dequantize(w).T for tiled 4/8-bit weights, x quantized
// to int16 per group. N a multiple of 16, group a multiple of 32.
void qmm_tiled(const QuantWeights& q, const float* x, int64_t M, float* y);

}  // namespace kvchat
