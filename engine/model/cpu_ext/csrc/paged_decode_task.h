// The pieces of one paged decode task (paged_decode_kernel.cpp): its share of the
// context, the online-softmax step of a block, and the register-resident kernel for
// plain pools (queries and accumulators in registers, fixed D and GQA group).
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>

#include "paged_decode_kernel.h"
#include "paged_decode_rows.h"
#include "pool.h"

namespace kvchat::decode_task {

// Online-softmax state of one task: running max, sum and output per head.
struct Partial {
  float* m;
  float* l;
  float* acc;  // heads x D (in V's row order)
};

// One head's output from its context partitions' states (`part_of(i)`, i < parts; head g of
// each): the states merged, a sink logit (null: none) joined to the denominator, and the
// sum normalized, into `row` (D floats, V's row order). NaN where a partition met a bad
// block id; zeros where no key was seen.
template <class PartOf>
inline void merge_head(int parts, int g, int D, const float* sink, PartOf part_of, float* row) {
  float m = -std::numeric_limits<float>::infinity();
  bool bad = false;
  for (int part = 0; part < parts; ++part) {
    const Partial st = part_of(part);
    m = std::max(m, st.m[g]);
    bad = bad || std::isnan(st.l[g]);
  }
  float l = bad ? std::numeric_limits<float>::quiet_NaN() : 0.0f;
  std::fill(row, row + D, 0.0f);
  if (!bad && m != -std::numeric_limits<float>::infinity()) {
    for (int part = 0; part < parts; ++part) {
      const Partial st = part_of(part);
      if (st.l[g] == 0.0f) continue;
      const float w = std::exp(st.m[g] - m);
      l += st.l[g] * w;
      const float* acc = st.acc + size_t(g) * D;
      for (int d = 0; d < D; ++d) row[d] += acc[d] * w;
    }
    // a sink adds exp(sink - m) to the denominator (o and l are relative to m)
    if (sink != nullptr) l += std::exp(*sink - m);
  }
  const float inv = std::isnan(l) ? l : l > 0.0f ? 1.0f / l : 0.0f;
  for (int d = 0; d < D; ++d) row[d] *= inv;
}

// Folded positions (`Problem::fold`): scores of block rows [r0, r1) (the block's first
// token `tok0`) that lie past head g's own position become a huge negative number, so that
// they weigh exp(-87) or less, nothing beside the visible keys: not -inf, as a partition
// seeing only such keys must keep finite state (its merge weight then is exactly 0).
inline void mask_folded(const Problem& pb, int b, int q_head0, int G, int tok0, int r0, int r1,
                        float* p, int padded_bs) {
  if (pb.fold == 1 || tok0 + r1 <= pb.lens[b] - pb.fold + 1) return;
  for (int g = 0; g < G; ++g) {
    const int end = pb.visible_end(b, q_head0 + g) - tok0;
    for (int r = std::max(r0, end); r < r1; ++r) p[size_t(g) * padded_bs + r] = -1e30f;
  }
}

// Split-K partitions are fixed spans of this many tokens (whole blocks when the block size
// divides it), counted from the first block a sequence attends to: a row's result then
// depends on its own context alone, never on its batch or on the rows folded with it
// (speculative decoding's verify rows are bit for bit plain decode rows).
constexpr int kPartitionTokens = 256;

inline int partition_span(const Problem& pb) {
  return (kPartitionTokens + pb.BS - 1) / pb.BS * pb.BS;
}

// The first token of the first block sequence b's last position attends to.
inline int first_block_token(const Problem& pb, int b) {
  return pb.first_key(pb.lens[b] - 1) / pb.BS * pb.BS;
}

// The partitions sequence b's context takes when split (`Problem::parts` is the most of
// any sequence's; the rest of its tasks are empty).
inline int partitions_of(const Problem& pb, int b) {
  const int len = pb.lens[b], base = first_block_token(pb, b);
  return std::max(1, (len - base + partition_span(pb) - 1) / partition_span(pb));
}

// The tokens [t0, t1) of sequence b that context partition `part` covers: its
// `partition_span` tokens from the first block it sees on (whole blocks, so partitions never
// share one; none past its own `partitions_of`). A sliding window: the first partition
// starts at the window's first key.
inline void token_range(const Problem& pb, int b, int part, int& t0, int& t1) {
  const int len = pb.lens[b];
  const int lo = pb.first_key(len - 1);
  const int base = first_block_token(pb, b);
  const int per_part = partition_span(pb);
  t0 = std::min(len, base + part * per_part);
  t1 = std::min(len, t0 + per_part);
  t0 = std::min(t1, std::max(t0, lo));
}

// One block's (or span's) online-softmax step for one head: scores pg[r0..r1) become
// exp(score - m_new) in place, m and l move on; returns the factor (0 on the
// first block) by which the caller rescales its output accumulator.
inline float softmax_block(float* pg, int r0, int r1, float& m, float& l) {
#if defined(__AVX512F__)
  // Masked vectors over [r0, r1): one max and one sum reduction per block, not a scalar
  // pass per row (the block's softmax cost as much as its 16 rows' dot products).
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 vmax = neg_inf;
  for (int c = r0; c < r1; c += W) {
    const __mmask16 k = r1 - c >= W ? __mmask16(0xffff) : __mmask16((1u << (r1 - c)) - 1);
    vmax = _mm512_max_ps(vmax, _mm512_mask_loadu_ps(neg_inf, k, pg + c));
  }
  const float m_new = std::max(m, _mm512_reduce_max_ps(vmax));
  const float alpha = m_new == m ? 1.0f : std::exp(m - m_new);  // exp(0) is 1 exactly
  m = m_new;
  __m512 vsum = _mm512_setzero_ps();
  const __m512 mv = _mm512_set1_ps(m_new);
  for (int c = r0; c < r1; c += W) {
    const __mmask16 k = r1 - c >= W ? __mmask16(0xffff) : __mmask16((1u << (r1 - c)) - 1);
    const __m512 x = _mm512_maskz_loadu_ps(k, pg + c);
    const vf e = exp_neg(reinterpret_cast<vf>(_mm512_sub_ps(x, mv)));
    _mm512_mask_storeu_ps(pg + c, k, reinterpret_cast<__m512>(e));
    vsum = _mm512_add_ps(vsum, _mm512_maskz_mov_ps(k, reinterpret_cast<__m512>(e)));
  }
  l = l * alpha + _mm512_reduce_add_ps(vsum);
  return alpha;
#else
  float block_max = pg[r0];
  for (int r = r0 + 1; r < r1; ++r) block_max = std::max(block_max, pg[r]);
  const float m_new = std::max(m, block_max);
  const float alpha = std::exp(m - m_new);
  m = m_new;
  float sum = 0.0f;
  int r = r0;
  for (; r + W <= r1; r += W) {
    const vf e = exp_neg(load(pg + r) - m_new);
    store(pg + r, e);
    sum += hsum(e);
  }
  for (; r < r1; ++r) {
    pg[r] = std::exp(pg[r] - m_new);
    sum += pg[r];
  }
  l = l * alpha + sum;
  return alpha;
#endif
}

// Up to kSpan consecutive blocks of a task's tokens, scored together and then normalized
// by one online-softmax step: its reductions, its exp of the rescale and the rescale itself
// are paid once a span instead of once a 16-row block (they were ~30 % of a 4k decode call).
// Spans need BS a multiple of W (the blocks' scores then lie end to end); else one block.
constexpr int kSpan = 4;

struct Span {
  int n = 0;  // blocks; 0 with `bad`: a bad block id (the task's output is NaN)
  bool bad = false;
  int end = 0;  // the token after the span
  int64_t row0[kSpan];
  int blk[kSpan], r0[kSpan], r1[kSpan];
};

inline Span next_span(const Problem& pb, int b, int h, int t, int t1, int t_first) {
  Span s;
  const int most = pb.BS % W == 0 ? kSpan : 1;
  while (s.n < most && t < t1) {
    const int blk = t / pb.BS, r0 = t % pb.BS, r1 = std::min(pb.BS, t1 - blk * pb.BS);
    const int64_t row0 = block_row0(pb, b, h, blk);
    if (row0 < 0) {
      s.bad = true;
      return s;
    }
    if (t == t_first)  // the first span's own blocks, then each block one span ahead
      for (int i = 1; i < most; ++i) prefetch_next_block(pb, b, h, blk, t1, i);
    prefetch_next_block(pb, b, h, blk, t1, most);
    s.row0[s.n] = row0;
    s.blk[s.n] = blk;
    s.r0[s.n] = r0;
    s.r1[s.n] = r1;
    ++s.n;
    t = blk * pb.BS + r1;
  }
  s.end = t;
  return s;
}

// `attend` with D = NV * W and G query heads per task fixed at compile time, for
// float and quantized pools alike: the scaled queries and the output accumulators
// live in registers (the general loop keeps them in memory, and each V row then
// costs a load and a store per accumulator), and rows are converted or dequantized
// as loaded. Blocks in spans (`next_span`): one softmax step per span where `attend`
// takes one per block, so the results differ from its in the last bits.
template <int NV, int G>
void attend_plain(const Problem& pb, int b, int h, int hc, int part, Partial st) {
  constexpr int D = NV * W;
  const int BS = pb.BS;
  const int q_head0 = h * (pb.Hq / pb.Hkv) + hc * pb.heads_per_task;
  int t0, t1;
  token_range(pb, b, part, t0, t1);
  const int padded_bs = (BS + W - 1) / W * W, stride = kSpan * padded_bs;
  thread_local std::vector<float> scratch;
  scratch.resize(size_t(G) * stride);
  float* p = scratch.data();
  vf q[G][NV], acc[G][NV];
  float m[G], l[G];
  float permuted[D];
  for (int g = 0; g < G; ++g) {
    const float* src = pb.q + (int64_t(b) * pb.Hq + q_head0 + g) * D;
    if (pb.k.bits == 4) {  // in the order 4-bit K rows come out of `load_row`
      permute4(src, permuted, D);
      src = permuted;
    }
    for (int j = 0; j < NV; ++j) {
      q[g][j] = load(src + j * W) * pb.scale;
      acc[g][j] = vf{};
    }
    m[g] = -std::numeric_limits<float>::infinity();
    l[g] = 0.0f;
  }
  for (int t = t0; t < t1;) {
    const Span sp = next_span(pb, b, h, t, t1, t0);
    if (sp.bad) {
      for (int g = 0; g < G; ++g) st.l[g] = std::numeric_limits<float>::quiet_NaN();
      return;
    }
    for (int i = 0; i < sp.n; ++i) {
      float* pi = p + i * padded_bs;
      if (kScores16 && BS % W == 0) {  // whole 16-row groups: rows of a group outside
        // [r0, r1) are scored too (their K rows lie in the block) and never read
        for (int r = sp.r0[i] / W * W; r < sp.r1[i]; r += W)
          scores16<NV, G>(pb.k, sp.row0[i] + r, q, pi + r, stride);
      } else {
        for (int r = sp.r0[i]; r < sp.r1[i]; ++r) {
          vf k[NV];
          load_row<NV>(pb.k, sp.row0[i] + r, k);
          vf dot[G];
          for (int g = 0; g < G; ++g) {
            dot[g] = vf{};
            for (int j = 0; j < NV; ++j) dot[g] += q[g][j] * k[j];
          }
          float s[G];
          hsums<G>(dot, s);  // the G sums together: ~3 shuffles and adds a head, not ~8
          for (int g = 0; g < G; ++g) pi[size_t(g) * stride + r] = s[g];
        }
      }
      mask_folded(pb, b, q_head0, G, sp.blk[i] * BS, sp.r0[i], sp.r1[i], pi, stride);
    }
    const int lo = sp.r0[0], hi = (sp.n - 1) * padded_bs + sp.r1[sp.n - 1];
    for (int g = 0; g < G; ++g) {
      const float alpha = softmax_block(p + size_t(g) * stride, lo, hi, m[g], l[g]);
      if (alpha != 1.0f)
        for (int j = 0; j < NV; ++j) acc[g][j] = acc[g][j] * alpha;
    }
    for (int i = 0; i < sp.n; ++i) {
      const float* pi = p + i * padded_bs;
      for (int r = sp.r0[i]; r < sp.r1[i]; ++r) {
        vf v[NV];
        load_row<NV>(pb.v, sp.row0[i] + r, v);
        for (int g = 0; g < G; ++g) {
          const vf pr = splat(pi[size_t(g) * stride + r]);
          for (int j = 0; j < NV; ++j) acc[g][j] = acc[g][j] + pr * v[j];
        }
      }
    }
    t = sp.end;
  }
  for (int g = 0; g < G; ++g) {
    st.m[g] = m[g];
    st.l[g] = l[g];
    for (int j = 0; j < NV; ++j) store(st.acc + size_t(g) * D + j * W, acc[g][j]);
  }
}

}  // namespace kvchat::decode_task
