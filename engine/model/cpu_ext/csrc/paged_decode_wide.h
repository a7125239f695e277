// The decode task for folded positions on float pools (speculative decoding's verify rows,
// `fold_positions`): one task takes every query head of a KV head's group (GQA heads x
// positions, 6-24 for the default model), where `attend_plain` takes 8 at most and so reads
// K and V again for each further 8. Its keys are scored 16 rows at a time with the rows
// across lanes (the tile transposed once, every head's score a broadcast query element
// times a key vector): no horizontal sum per (key, head), which in `attend_plain` cost more
// than the dot products themselves and, with 7-8 heads, spilled its queries from registers.
// The same online softmax (`softmax_block`, spans of blocks); the output accumulators live
// in the task's partial state and come into registers 6 heads at a time for each span.
// The dot products add in another order than `attend_plain`'s: the last bits differ.
#pragma once

#include <algorithm>
#include <cstdlib>
#include <limits>
#include <vector>

#include "paged_decode_task.h"

namespace kvchat::decode_task {

// Whether `attend_wide` takes a folded problem: float K and V rows of 64 or 128 elements
// and blocks of whole 16-row tiles. KVCHAT_WIDE=0 leaves every fold to `attend_plain` (to
// compare the two).
inline bool wide_applies(const Problem& pb) {
  static const bool on = [] {
    const char* env = std::getenv("KVCHAT_WIDE");
    return !(env && env[0] == '0');
  }();
  return on && pb.fold > 1 && pb.k.bits == 0 && pb.v.bits == 0 && pb.BS % W == 0 &&
         (pb.D == 4 * W || pb.D == 8 * W);
}

namespace wide {

constexpr int kScoreHeads = 12;  // score accumulators (16 keys each) in registers at once

// Rows [row, row + W) of a float side transposed into kt (D x W): kt[d * W + i] is
// element d of row + i.
template <int NV>
__attribute__((always_inline)) inline void transpose_tile(const Side& k, int64_t row,
                                                          float* kt) {
  constexpr int D = NV * W;
  for (int s = 0; s < NV; ++s) {
    vf m[W];
    for (int i = 0; i < W; ++i) m[i] = load_any(k.data, k.elem, (row + i) * D + s * W);
    transpose16(m);
    for (int i = 0; i < W; ++i) store(kt + (s * W + i) * W, m[i]);
  }
}

// Scores of the tile's W keys for C heads (queries q, C x D, scaled) into out (stride apart).
template <int C, int D>
__attribute__((always_inline)) inline void score_tile(const float* kt, const float* q,
                                                      float* out, int stride) {
  vf s[C];
  for (int g = 0; g < C; ++g) s[g] = vf{};
  for (int d = 0; d < D; ++d) {
    const vf kd = load(kt + d * W);
    for (int g = 0; g < C; ++g) s[g] += kd * splat(q[g * D + d]);
  }
  for (int g = 0; g < C; ++g) store(out + size_t(g) * stride, s[g]);
}

template <int D>
inline void score_heads(int c, const float* kt, const float* q, float* out, int stride) {
  switch (c) {
    case 1: return score_tile<1, D>(kt, q, out, stride);
    case 2: return score_tile<2, D>(kt, q, out, stride);
    case 3: return score_tile<3, D>(kt, q, out, stride);
    case 4: return score_tile<4, D>(kt, q, out, stride);
    case 5: return score_tile<5, D>(kt, q, out, stride);
    case 6: return score_tile<6, D>(kt, q, out, stride);
    case 7: return score_tile<7, D>(kt, q, out, stride);
    case 8: return score_tile<8, D>(kt, q, out, stride);
    case 9: return score_tile<9, D>(kt, q, out, stride);
    case 10: return score_tile<10, D>(kt, q, out, stride);
    case 11: return score_tile<11, D>(kt, q, out, stride);
    default: return score_tile<12, D>(kt, q, out, stride);
  }
}

// C heads' outputs (acc, C x D in memory) += their probabilities (p, stride apart) times
// the span's value rows (vr: `rows` of D floats), the accumulators in registers meanwhile
// and each value element a memory operand of its C multiply-adds.
template <int C, int NV>
inline void accumulate(const float* vr, int rows, const float* p, int stride, float* acc) {
  constexpr int D = NV * W;
  vf a[C][NV];
  for (int g = 0; g < C; ++g)
    for (int j = 0; j < NV; ++j) a[g][j] = load(acc + g * D + j * W);
  for (int r = 0; r < rows; ++r) {
    for (int g = 0; g < C; ++g) {
      const vf pr = splat(p[size_t(g) * stride + r]);
      for (int j = 0; j < NV; ++j) a[g][j] += pr * load(vr + r * D + j * W);
    }
  }
  for (int g = 0; g < C; ++g)
    for (int j = 0; j < NV; ++j) store(acc + g * D + j * W, a[g][j]);
}

// Heads whose accumulators fit the registers at once: 7 x 4 vectors at D 64, 3 x 8 at 128.
template <int NV>
constexpr int kValueHeads = NV == 4 ? 7 : 3;

template <int NV>
inline void accumulate_heads(int c, const float* vr, int rows, const float* p, int stride,
                             float* acc) {
  switch (c) {
    case 1: return accumulate<1, NV>(vr, rows, p, stride, acc);
    case 2: return accumulate<2, NV>(vr, rows, p, stride, acc);
    case 3: return accumulate<3, NV>(vr, rows, p, stride, acc);
  }
  if constexpr (kValueHeads<NV> == 7) {
    switch (c) {
      case 4: return accumulate<4, NV>(vr, rows, p, stride, acc);
      case 5: return accumulate<5, NV>(vr, rows, p, stride, acc);
      case 6: return accumulate<6, NV>(vr, rows, p, stride, acc);
      default: return accumulate<7, NV>(vr, rows, p, stride, acc);
    }
  }
}

// n heads in chunks of at most `most`, as even as can be: fn(first head, heads).
template <class Fn>
inline void chunks(int n, int most, Fn fn) {
  const int count = (n + most - 1) / most;
  for (int c = 0, g = 0; c < count; ++c) {
    const int size = (n - g) / (count - c);
    fn(g, size);
    g += size;
  }
}

}  // namespace wide

// One (sequence, KV head, context partition) task of a folded float problem: every query
// head of the group (pb.heads_per_task of them, `fold_positions` sets it so).
template <int NV>
void attend_wide(const Problem& pb, int b, int h, int part, Partial st) {
  using namespace wide;
  constexpr int D = NV * W;
  const int G = pb.heads_per_task, BS = pb.BS, stride = kSpan * BS;
  const int q_head0 = h * G;
  int t0, t1;
  token_range(pb, b, part, t0, t1);
  thread_local std::vector<float> scratch;
  scratch.resize(size_t(G) * (stride + D) + size_t(kSpan) * BS * D);
  float* p = scratch.data();  // G x stride scores, then probabilities
  float* q = p + size_t(G) * stride;  // G x D scaled queries
  float* vr = q + size_t(G) * D;  // the span's value rows as floats
  alignas(64) float kt[D * W];
  for (int g = 0; g < G; ++g) {
    const float* src = pb.q + (int64_t(b) * pb.Hq + q_head0 + g) * D;
    for (int d = 0; d < D; ++d) q[g * D + d] = src[d] * pb.scale;
    st.m[g] = -std::numeric_limits<float>::infinity();
    st.l[g] = 0.0f;
    std::fill(st.acc + size_t(g) * D, st.acc + size_t(g + 1) * D, 0.0f);
  }
  for (int t = t0; t < t1;) {
    const Span sp = next_span(pb, b, h, t, t1, t0);
    if (sp.bad) {
      for (int g = 0; g < G; ++g) st.l[g] = std::numeric_limits<float>::quiet_NaN();
      return;
    }
    for (int i = 0; i < sp.n; ++i) {
      float* pi = p + i * BS;
      for (int r = sp.r0[i] / W * W; r < sp.r1[i]; r += W) {  // whole tiles: BS % W == 0
        transpose_tile<NV>(pb.k, sp.row0[i] + r, kt);
        chunks(G, kScoreHeads, [&](int g, int c) {
          score_heads<D>(c, kt, q + g * D, pi + g * stride + r, stride);
        });
      }
      mask_folded(pb, b, q_head0, G, sp.blk[i] * BS, sp.r0[i], sp.r1[i], pi, stride);
    }
    const int lo = sp.r0[0], hi = (sp.n - 1) * BS + sp.r1[sp.n - 1];
    for (int g = 0; g < G; ++g) {
      const float alpha = softmax_block(p + size_t(g) * stride, lo, hi, st.m[g], st.l[g]);
      if (alpha != 1.0f) {
        float* acc = st.acc + size_t(g) * D;
        for (int d = 0; d < D; d += W) store(acc + d, load(acc + d) * alpha);
      }
    }
    int rows = 0;  // the span's visible rows, converted once for every chunk of heads
    for (int i = 0; i < sp.n; ++i)
      for (int r = sp.r0[i]; r < sp.r1[i]; ++r, ++rows) {
        vf x[NV];
        load_row<NV>(pb.v, sp.row0[i] + r, x);
        for (int j = 0; j < NV; ++j) store(vr + rows * D + j * W, x[j]);
      }
    chunks(G, kValueHeads<NV>, [&](int g, int c) {
      accumulate_heads<NV>(c, vr, rows, p + g * stride + lo, stride, st.acc + size_t(g) * D);
    });
    t = sp.end;
  }
}

}  // namespace kvchat::decode_task
