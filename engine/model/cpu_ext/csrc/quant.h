// MLX affine-quantized weights as the quantized matmul reads them (qmm.cpp's
// decode GEMV, qgemm.cpp's prefill GEMM).
#pragma once

#include <cstdint>
#include <cstring>

#include "simd.h"

namespace kvchat {

inline vb load_bytes(const uint8_t* p) {
  vb v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

struct QuantWeights {
  const uint8_t* w;  // N rows of K * bits / 8 bytes
  const void* scales;  // N x G
  const void* biases;  // null: each bias is bias_factor x its scale (tiled kernels only)
  Elem elem;  // of scales and biases
  int K, N, G, group, bits;
  // A symmetric format (GGUF Q4_0/Q8_0: w = d * (q - 8) / d * (q - 128)) needs no stored
  // biases: -8 x a float16 scale is exact in float32, so the results are the same bits.
  float bias_factor = 0.0f;
  // GGUF K-quant steps (tiled kernels only): scales and biases are uint8 codes, per tile
  // and 8 groups 160 bytes: codes (group, row), then 16 float16 steps (`cpu_ext/kquant.py`).
  bool kquant = false;

  int64_t row_bytes() const {
    return int64_t(K) * bits / 8;
  }

  // Row n's scales and biases as floats (G each).
  void row_params(int n, float* s, float* b) const {
    const int64_t base = int64_t(n) * G;
    int g = 0;
    for (; g + W <= G; g += W) {
      store(s + g, load_any(scales, elem, base + g));
      store(b + g, load_any(biases, elem, base + g));
    }
    for (; g < G; ++g) {
      s[g] = scalar_any(scales, elem, base + g);
      b[g] = scalar_any(biases, elem, base + g);
    }
  }
};

// y (M x N, row-major) = x (M x K) @ dequantize(w).T for many rows of x
// (qgemm.cpp); float32 throughout.
void gemm(const QuantWeights& q, const float* x, int64_t M, float* y);

}  // namespace kvchat
