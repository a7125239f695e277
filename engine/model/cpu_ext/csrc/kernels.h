// The computations behind the primitives, callable inside another primitive's task
// (layer_ops.cpp runs several in one node). Inputs are evaluated arrays; each writes
// `out` (allocated by the caller) exactly as its primitive would.
#pragma once

#include <cstdint>

#include <vector>

#include "mlx/array.h"
#include "norm_rope.h"

namespace kvchat {

namespace mx = mlx::core;

// QuantizedMatmul: out = x @ dequantize(w, scales, biases).T (qmm.cpp). Tiled weights of a
// symmetric format may pass biases (1, 1): one factor, each bias that times its scale.
void qmm_into(const mx::array& x, const mx::array& w, const mx::array& scales,
              const mx::array& biases, mx::array& out, int group, int bits, bool tiled);

// Whether `biases` is such a (1, 1) factor rather than one bias per scale.
inline bool scaled_biases(const mx::array& biases, const mx::array& scales) {
  return biases.ndim() == 2 && biases.shape(0) == 1 && biases.shape(1) == 1 &&
         scales.shape() != biases.shape();
}

// K-quant steps (tiled weights only): scales and biases as uint8 codes, each group's
// float16 value its code times a float16 step per 8 groups (`cpu_ext/kquant.py`'s layout).
inline bool kquant_params(const mx::array& scales) {
  return scales.dtype() == mx::uint8;
}

// The float dtype scales and biases stand for (K-quant codes: float16, as converted).
inline mx::Dtype param_dtype(const mx::array& scales) {
  return kquant_params(scales) ? mx::float16 : scales.dtype();
}

// What `qmm` checks of its arguments, for an x of K columns (std::invalid_argument when
// they do not fit).
void check_qmm(int K, mx::Dtype x_dtype, const mx::array& w, const mx::array& scales,
               const mx::array& biases, int group_size, int bits, bool tiled);

// RmsNorm over the last axis (norm_rope.cpp).
void rms_norm_into(const mx::array& x, const mx::array& w, mx::array& out, float eps);

// SwiGLU of float32 rows: y (rows x D, dense) = silu(g) * u, g and u rows `ldg` / `ldu`
// floats apart (swiglu.cpp).
void swiglu_rows(const float* g, int64_t ldg, const float* u, int64_t ldu, int64_t rows,
                 int64_t D, float* y);

// act(gate, up) of float arrays of one shape into n elements at `out` of `dtype`, as the
// `swiglu` / `gelu_tanh_mul` / `clip_add` primitive computes it (swiglu.cpp).
void gated_into(const mx::array& gate, const mx::array& up, char* out, mx::Dtype dtype,
                int64_t n, GateAct act);
// The same into all of `out`.
void gated_into(const mx::array& gate, const mx::array& up, mx::array& out, GateAct act);

// A fused projection qkv (B, L, (heads + 2 kv_heads) * D) -> out: q (B, heads, L, D),
// k and v (kv_heads, B * L, D), q and k RoPE'd at offsets + 0..L-1 (`freqs`, when given,
// as `rope`'s) (qkv_rope.cpp).
void qkv_rope_into(const mx::array& qkv, const mx::array& offsets, std::vector<mx::array>& out,
                   int heads, int kv_heads, const RopeParams& p, const float* freqs = nullptr);

// One row of D floats times kvchat's rotation R (`inverse`: times R^T): `signs` (D,) of
// R's blocks, which are D's largest power-of-two divisor wide (hadamard.cpp).
void hadamard_row(const float* x, float* y, int D, const float* signs, bool inverse);

// x (..., D) times R (or R^T), float32 math rounded to x's dtype: one node.
mx::array hadamard(const mx::array& x, const mx::array& signs, bool inverse,
                   mx::StreamOrDevice s = {});

// Heads of a token-row layout: B, L, query heads, KV heads, head dim.
struct Heads {
  int64_t B, L, Hq, Hkv, D;
};

}  // namespace kvchat
