// One decode call over a residual-format pool, as the kernel reads it
// (paged_residual_kernel.cpp; the op and its checks: paged_residual.cpp).
#pragma once

#include <cstdint>
#include <cstring>

#include "paged_decode_kernel.h"

namespace kvchat {

constexpr int kResidualMaxHeads = 8;  // query heads per task (a GQA group in chunks of this)
constexpr int kResidualHeadDims[] = {64, 128};  // the head dims the kernel is built for

struct ResidualProblem {
  const float* q;  // (B, Hq, D) scaled queries, for exact (residual) keys
  const float* qk;  // the same times R where the quantized keys are rotated
  const uint8_t* k_codes;  // (Hkv, num_blocks, D, k_width)
  const void* k_scales;  // (Hkv, num_blocks, D)
  const void* k_biases;
  Elem k_elem;
  int k_bits, k_width;  // k_width = BS * k_bits / 8
  Side v;  // per-token quantized value rows
  const void* res_k;  // (Hkv, nres, BS, D)
  const void* res_v;
  Elem res_elem;
  int nres;
  const int32_t* res_map;  // (num_blocks,)
  const int32_t* tables;
  int64_t table_width;
  const int32_t* lens;
  int B, Hq, Hkv, D, BS, num_blocks;
  int heads_per_task, head_chunks;
  int window;  // > 0: a row sees its last `window` positions only (sliding-window layers)
  const float* sinks;  // (Hq,) or null
  const float* signs;  // R's (D,) signs, or null
  bool rotate_k, rotate_v;
};

// Decode (queries (B, Hq, 1, D)): out (B, Hq, D) float32.
void run_residual_decode(const ResidualProblem& pb, float* out);

// Prefill, the L newest positions of each sequence (queries (B, Hq, L, D), causal):
// out (B, Hq, L, D) float32 (paged_residual_prefill.cpp).
void run_residual_prefill(const ResidualProblem& pb, int L, float* out);

// 16 codes of one channel (tokens 16c .. 16c + 15) as floats.
inline vf channel_codes(const uint8_t* codes, int bits, int c) {
  vb x{};
  if (bits == 8) {
    std::memcpy(&x, codes + c * 16, 16);
    return bytes_to_float(x);
  }
  // token 2i in byte i's low nibble, 2i + 1 its high; one 8-byte load (a memcpy into the
  // vector is a store the 16-byte read cannot forward from: a stall per channel)
#if defined(__SSE2__)
  x = (vb)_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + c * 8));
#else
  std::memcpy(&x, codes + c * 8, 8);
#endif
  vb first, second;
  interleave(x & 15, x >> 4, first, second);
  return bytes_to_float(first);
}

// Scores of a quantized block's BS tokens for G heads into p (G rows, `stride` apart).
template <int G>
inline void channel_scores(const ResidualProblem& pb, int64_t blk_id, const float* qk,
                           float* qs, float* p, int stride) {
  const int D = pb.D;
  const int64_t param0 = blk_id * D;
  float cst[G];
  for (int g = 0; g < G; ++g) {
    vf c{};
    for (int d = 0; d < D; d += W) {
      const vf q = load(qk + size_t(g) * D + d);
      store(qs + size_t(g) * D + d, q * load_any(pb.k_scales, pb.k_elem, param0 + d));
      c += q * load_any(pb.k_biases, pb.k_elem, param0 + d);
    }
    cst[g] = hsum(c);
  }
  const uint8_t* base = pb.k_codes + param0 * pb.k_width;
  for (int c = 0; c < pb.BS / W; ++c) {
    vf acc[G];
    for (int g = 0; g < G; ++g) acc[g] = splat(cst[g]);
    for (int d = 0; d < D; ++d) {
      const vf codes = channel_codes(base + int64_t(d) * pb.k_width, pb.k_bits, c);
      for (int g = 0; g < G; ++g) acc[g] += splat(qs[size_t(g) * D + d]) * codes;
    }
    for (int g = 0; g < G; ++g) store(p + size_t(g) * stride + c * W, acc[g]);
  }
}

// An exact value row x (or a sum of them) in the quantized rows' space: times R, then
// 4-bit element order; may return x itself, else one of tmp / out.
const float* stored_space(const ResidualProblem& pb, const float* x, float* tmp, float* out);

// The inverse: a row x of the stored value space into out as a plain row (tmp: D floats).
void plain_space(const ResidualProblem& pb, const float* x, float* tmp, float* out);

}  // namespace kvchat
