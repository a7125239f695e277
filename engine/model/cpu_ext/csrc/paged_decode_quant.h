// The register-resident decode task for quantized pools (AVX-512 VNNI builds), and the
// choice of the specialized task for a problem (paged_decode_kernel.cpp).
//
// `attend_plain` dequantizes a quantized row into floats before its dot products; here a
// quantized K side is scored 16 rows at a time by integer dot products and a quantized V
// side is accumulated as (p * s) * v_int with the biases summed apart (paged_decode_qk.h):
// the same attention within rounding (the queries meet the keys as int16), a few times
// fewer instructions per row. A float side keeps `attend_plain`'s loop. Kept apart from
// `attend_plain` so that the float pools' code stays as it was compiled before.
#pragma once

#include "paged_decode_qk.h"
#include "paged_decode_task.h"

namespace kvchat::decode_task {

template <int NV, int G>
void attend_quant(const Problem& pb, int b, int h, int hc, int part, Partial st) {
  constexpr int D = NV * W;
  const int BS = pb.BS;
  const int q_head0 = h * (pb.Hq / pb.Hkv) + hc * pb.heads_per_task;
  int t0, t1;
  token_range(pb, b, part, t0, t1);
  const int padded_bs = (BS + W - 1) / W * W, stride = kSpan * padded_bs;
  thread_local std::vector<float> scratch;
  scratch.resize(size_t(G) * stride);
  float* p = scratch.data();
  alignas(64) float qf[G * D];  // scaled queries, in K rows' element order
  vf acc[G][NV];
  float m[G], l[G], bias[G][kMaxKeyGroups] = {};
  for (int g = 0; g < G; ++g) {
    const float* src = pb.q + (int64_t(b) * pb.Hq + q_head0 + g) * D;
    float* dst = qf + g * D;
    if (pb.k.bits == 4)  // in the order 4-bit K rows are scored
      permute4(src, dst, D);
    else
      std::copy(src, src + D, dst);
    for (int j = 0; j < NV; ++j) {
      store(dst + j * W, load(dst + j * W) * pb.scale);
      acc[g][j] = vf{};
    }
    m[g] = -std::numeric_limits<float>::infinity();
    l[g] = 0.0f;
  }
  IntQueries<D, G> qq;
  if (pb.k.bits) qq.set(qf, pb.k.group);
  for (int t = t0; t < t1;) {
    const Span sp = next_span(pb, b, h, t, t1, t0);
    if (sp.bad) {
      for (int g = 0; g < G; ++g) st.l[g] = std::numeric_limits<float>::quiet_NaN();
      return;
    }
    for (int i = 0; i < sp.n; ++i) {
      float* pi = p + i * padded_bs;
      const int64_t row0 = sp.row0[i];
      const int r0 = sp.r0[i], r1 = sp.r1[i];
      if (pb.k.bits) {
        score_block<D, G>(pb.k, row0, r0, r1, qq, pi, stride);
      } else {
        for (int r = r0; r < r1; ++r) {
          vf k[NV];
          load_row<NV>(pb.k, row0 + r, k);
          for (int g = 0; g < G; ++g) {
            vf dot{};
            for (int j = 0; j < NV; ++j) dot += load(qf + g * D + j * W) * k[j];
            pi[size_t(g) * stride + r] = hsum(dot);
          }
        }
      }
      mask_folded(pb, b, q_head0, G, sp.blk[i] * BS, r0, r1, pi, stride);
    }
    const int lo = sp.r0[0], hi = (sp.n - 1) * padded_bs + sp.r1[sp.n - 1];
    for (int g = 0; g < G; ++g) {
      const float alpha = softmax_block(p + size_t(g) * stride, lo, hi, m[g], l[g]);
      if (alpha != 1.0f) {
        for (int j = 0; j < NV; ++j) acc[g][j] = acc[g][j] * alpha;
        for (int gi = 0; gi < kMaxKeyGroups; ++gi) bias[g][gi] *= alpha;
      }
    }
    for (int i = 0; i < sp.n; ++i) {
      const float* pi = p + i * padded_bs;
      const int64_t row0 = sp.row0[i];
      const int r0 = sp.r0[i], r1 = sp.r1[i];
      if (pb.v.bits) {
        value_block<NV, G>(pb.v, row0, r0, r1, pi, stride, acc, bias);
      } else {
        for (int r = r0; r < r1; ++r) {
          vf v[NV];
          load_row<NV>(pb.v, row0 + r, v);
          for (int g = 0; g < G; ++g) {
            const vf pr = splat(pi[size_t(g) * stride + r]);
            for (int j = 0; j < NV; ++j) acc[g][j] = acc[g][j] + pr * v[j];
          }
        }
      }
    }
    t = sp.end;
  }
  if (pb.v.bits) add_value_biases<NV, G>(pb.v, acc, bias);
  for (int g = 0; g < G; ++g) {
    st.m[g] = m[g];
    st.l[g] = l[g];
    for (int j = 0; j < NV; ++j) store(st.acc + size_t(g) * D + j * W, acc[g][j]);
  }
}

using AttendFn = void (*)(const Problem&, int, int, int, int, Partial);

template <int NV, template <int, int> class Task>
struct ForHeads {
  static AttendFn pick(int G) {
    switch (G) {
      case 1: return Task<NV, 1>::run;
      case 2: return Task<NV, 2>::run;
      case 3: return Task<NV, 3>::run;
      case 4: return Task<NV, 4>::run;
      case 5: return Task<NV, 5>::run;
      case 6: return Task<NV, 6>::run;
      case 7: return Task<NV, 7>::run;
      case 8: return Task<NV, 8>::run;
      default: return nullptr;
    }
  }
};

template <int NV, int G>
struct PlainTask {
  static void run(const Problem& pb, int b, int h, int hc, int part, Partial st) {
    attend_plain<NV, G>(pb, b, h, hc, part, st);
  }
};

template <int NV, int G>
struct QuantTask {
  static void run(const Problem& pb, int b, int h, int hc, int part, Partial st) {
    attend_quant<NV, G>(pb, b, h, hc, part, st);
  }
};

// The specialized `attend` for this task's shape and pool format, or nullptr for the
// general one.
inline AttendFn plain_attend(const Problem& pb, int G) {
  const bool quant = kIntKeys && (pb.k.bits != 0 || pb.v.bits != 0);
  if (pb.D == 4 * W)
    return quant ? ForHeads<4, QuantTask>::pick(G) : ForHeads<4, PlainTask>::pick(G);
  if (pb.D == 8 * W)
    return quant ? ForHeads<8, QuantTask>::pick(G) : ForHeads<8, PlainTask>::pick(G);
  return nullptr;
}

}  // namespace kvchat::decode_task
