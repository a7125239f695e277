// Decode attention straight from the block-paged KV pool (one query per
// sequence), the contract of engine/model/paged_attention.py for L == 1.
//
// One task per (sequence, KV head, head chunk, context partition): each K and V
// row is read once and used by every query head of its GQA group; an online
// softmax runs block by block (vectorized exp), and partitions of a long
// context are merged at the end (split-K), so one sequence still uses both
// cores. Quantized rows (mx.quantize, 4/8 bits) are dequantized as read.
#include "paged_decode_kernel.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "pool.h"

namespace kvchat {

namespace {

constexpr int kMinPartitionTokens = 256;  // split-K only for contexts longer than this
constexpr int64_t kParallelMinElements = 1 << 18;  // K/V elements read

// Online-softmax state of one task: running max, sum and output per head.
struct Partial {
  float* m;
  float* l;
  float* acc;  // heads x D (in V's row order)
};

// The tokens [t0, t1) of sequence b that context partition `part` covers
// (whole blocks, so partitions never share one).
inline void token_range(const Problem& pb, int b, int part, int& t0, int& t1) {
  const int len = pb.lens[b];
  const int per_part = ((len + pb.parts - 1) / pb.parts + pb.BS - 1) / pb.BS * pb.BS;
  t0 = std::min(len, part * per_part);
  t1 = std::min(len, t0 + per_part);
}

// One block's online-softmax step for one head: scores pg[r0..r1) become
// exp(score - m_new) in place, m and l move on; returns the factor (0 on the
// first block) by which the caller rescales its output accumulator.
inline float softmax_block(float* pg, int r0, int r1, float& m, float& l) {
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
}

// K row j (D / W vectors) of a plain pool, as floats.
template <int NV>
inline void load_row(const Side& side, int64_t row, vf* out) {
  const int64_t base = row * NV * W;
  for (int j = 0; j < NV; ++j) out[j] = load_any(side.data, side.elem, base + j * W);
}

// `attend` for plain (float) pools with D = NV * W and G query heads per task,
// fixed at compile time: the scaled queries and the output accumulators live
// in registers (the general loop keeps them in memory, and each V row then
// costs a load and a store per accumulator), and rows are converted as loaded.
// Same operations in the same order as `attend`, so the same results.
template <int NV, int G>
void attend_plain(const Problem& pb, int b, int h, int hc, int part, Partial st) {
  constexpr int D = NV * W;
  const int BS = pb.BS;
  const int q_head0 = h * (pb.Hq / pb.Hkv) + hc * pb.heads_per_task;
  int t0, t1;
  token_range(pb, b, part, t0, t1);
  const int padded_bs = (BS + W - 1) / W * W;
  thread_local std::vector<float> scratch;
  scratch.resize(size_t(G) * padded_bs);
  float* p = scratch.data();
  vf q[G][NV], acc[G][NV];
  float m[G], l[G];
  for (int g = 0; g < G; ++g) {
    const float* src = pb.q + (int64_t(b) * pb.Hq + q_head0 + g) * D;
    for (int j = 0; j < NV; ++j) {
      q[g][j] = load(src + j * W) * pb.scale;
      acc[g][j] = vf{};
    }
    m[g] = -std::numeric_limits<float>::infinity();
    l[g] = 0.0f;
  }
  for (int t = t0; t < t1;) {
    const int blk = t / BS, r0 = t % BS, r1 = std::min(BS, t1 - blk * BS);
    const int64_t row0 = block_row0(pb, b, h, blk);
    if (row0 < 0) {
      for (int g = 0; g < G; ++g) st.l[g] = std::numeric_limits<float>::quiet_NaN();
      return;
    }
    for (int r = r0; r < r1; ++r) {
      vf k[NV];
      load_row<NV>(pb.k, row0 + r, k);
      for (int g = 0; g < G; ++g) {
        vf dot{};
        for (int j = 0; j < NV; ++j) dot += q[g][j] * k[j];
        p[size_t(g) * padded_bs + r] = hsum(dot);
      }
    }
    for (int g = 0; g < G; ++g) {
      const float alpha = softmax_block(p + size_t(g) * padded_bs, r0, r1, m[g], l[g]);
      if (alpha != 1.0f)
        for (int j = 0; j < NV; ++j) acc[g][j] = acc[g][j] * alpha;
    }
    for (int r = r0; r < r1; ++r) {
      vf v[NV];
      load_row<NV>(pb.v, row0 + r, v);
      for (int g = 0; g < G; ++g) {
        const vf pr = splat(p[size_t(g) * padded_bs + r]);
        for (int j = 0; j < NV; ++j) acc[g][j] = acc[g][j] + pr * v[j];
      }
    }
    t = blk * BS + r1;
  }
  for (int g = 0; g < G; ++g) {
    st.m[g] = m[g];
    st.l[g] = l[g];
    for (int j = 0; j < NV; ++j) store(st.acc + size_t(g) * D + j * W, acc[g][j]);
  }
}

using AttendFn = void (*)(const Problem&, int, int, int, int, Partial);

template <int NV>
AttendFn plain_for_heads(int G) {
  switch (G) {
    case 1: return attend_plain<NV, 1>;
    case 2: return attend_plain<NV, 2>;
    case 3: return attend_plain<NV, 3>;
    case 4: return attend_plain<NV, 4>;
    case 5: return attend_plain<NV, 5>;
    case 6: return attend_plain<NV, 6>;
    case 7: return attend_plain<NV, 7>;
    case 8: return attend_plain<NV, 8>;
    default: return nullptr;
  }
}

// The specialized `attend` for this task's shape, or nullptr for the general one.
AttendFn plain_attend(const Problem& pb, int G) {
  if (pb.k.bits != 0 || pb.v.bits != 0) return nullptr;
  if (pb.D == 4 * W) return plain_for_heads<4>(G);
  if (pb.D == 8 * W) return plain_for_heads<8>(G);
  return nullptr;
}

void attend(const Problem& pb, int b, int h, int hc, int part, Partial st) {
  const int G = std::min(pb.heads_per_task, pb.Hq / pb.Hkv - hc * pb.heads_per_task);
  if (AttendFn fast = plain_attend(pb, G)) return fast(pb, b, h, hc, part, st);
  const int D = pb.D, BS = pb.BS;
  const int q_head0 = h * (pb.Hq / pb.Hkv) + hc * pb.heads_per_task;
  int t0, t1;
  token_range(pb, b, part, t0, t1);
  const int padded_bs = (BS + W - 1) / W * W;

  thread_local std::vector<float> scratch;
  scratch.resize(size_t(G) * D + size_t(G) * padded_bs + 2 * size_t(D));
  float* q = scratch.data();  // G x D, scaled, in K's row order
  float* p = q + size_t(G) * D;  // G x padded_bs scores, then probabilities
  float* kbuf = p + size_t(G) * padded_bs;
  float* vbuf = kbuf + D;
  for (int g = 0; g < G; ++g) {
    const float* src = pb.q + (int64_t(b) * pb.Hq + q_head0 + g) * D;
    float* dst = q + size_t(g) * D;
    if (pb.k.bits == 4)
      permute4(src, dst, D);
    else
      std::copy(src, src + D, dst);
    for (int d = 0; d < D; ++d) dst[d] *= pb.scale;
  }
  for (int g = 0; g < G; ++g) {
    st.m[g] = -std::numeric_limits<float>::infinity();
    st.l[g] = 0.0f;
    std::fill(st.acc + size_t(g) * D, st.acc + size_t(g + 1) * D, 0.0f);
  }

  for (int t = t0; t < t1;) {
    const int blk = t / BS, r0 = t % BS, r1 = std::min(BS, t1 - blk * BS);
    const int64_t row0 = block_row0(pb, b, h, blk);
    if (row0 < 0) {
      for (int g = 0; g < G; ++g) st.l[g] = std::numeric_limits<float>::quiet_NaN();
      return;
    }
    // Scores of this block's rows for every head of the group.
    for (int r = r0; r < r1; ++r) {
      const float* kr = pb.k.row(row0 + r, kbuf);
      vf dot[kMaxHeadsPerTask];
      for (int g = 0; g < G; ++g) dot[g] = vf{};
      for (int d = 0; d < D; d += W) {
        const vf kv = load(kr + d);
        for (int g = 0; g < G; ++g) dot[g] += load(q + size_t(g) * D + d) * kv;
      }
      for (int g = 0; g < G; ++g) p[size_t(g) * padded_bs + r] = hsum(dot[g]);
    }
    // Update the running max, rescale, and turn scores into probabilities.
    for (int g = 0; g < G; ++g) {
      const float alpha = softmax_block(p + size_t(g) * padded_bs, r0, r1, st.m[g], st.l[g]);
      float* acc = st.acc + size_t(g) * D;
      if (alpha != 1.0f)
        for (int d = 0; d < D; d += W) store(acc + d, load(acc + d) * alpha);
    }
    // Accumulate the value rows.
    for (int r = r0; r < r1; ++r) {
      const float* vr = pb.v.row(row0 + r, vbuf);
      for (int d = 0; d < D; d += W) {
        const vf vv = load(vr + d);
        for (int g = 0; g < G; ++g) {
          float* acc = st.acc + size_t(g) * D + d;
          store(acc, load(acc) + splat(p[size_t(g) * padded_bs + r]) * vv);
        }
      }
    }
    t = blk * BS + r1;
  }
}

int choose_parts(int units, int max_len, int threads) {
  if (threads <= 1 || units >= 2 * threads) return 1;
  const int want = (2 * threads + units - 1) / units;
  const int most = std::max(1, max_len / kMinPartitionTokens);
  return std::max(1, std::min(want, most));
}

}  // namespace

void run_problem(Problem pb, float* out /* (B, Hq, D) */) {
  // Waking a sleeping second thread costs 50-300 us on the 2-core build VMs,
  // but in a decode step the matmul just before has left it spinning: problems
  // from 2^18 K/V elements (~700 tokens of context for the default model, 3 KV
  // heads) split. Measured: 1x1024 f16 ~110 -> 83 us, 1x4096 266 -> 220 us; a
  // batch of 8 at 300 tokens had left a core idle.
  int64_t rows_read = 0;  // K and V rows of every (sequence, KV head)
  int max_len = 0;
  for (int b = 0; b < pb.B; ++b) {
    rows_read += 2 * int64_t(pb.lens[b]) * pb.Hkv;
    max_len = std::max(max_len, pb.lens[b]);
  }
  auto& pool = ThreadPool::instance();
  const bool parallel = rows_read * pb.D >= kParallelMinElements && pool.size() > 1;
  const int tasks_per_part = pb.B * pb.Hkv * pb.head_chunks;
  pb.parts = parallel ? choose_parts(tasks_per_part, max_len, pool.size()) : 1;
  const int num_tasks = tasks_per_part * pb.parts;
  const int H = pb.heads_per_task, D = pb.D;
  // Partial results of every task: m, l (H each) and acc (H x D).
  std::vector<float> partials(size_t(num_tasks) * H * (D + 2));
  auto partial = [&](int task) {
    float* base = partials.data() + size_t(task) * H * (D + 2);
    return Partial{base, base + H, base + 2 * H};
  };
  auto body = [&](int task) {
    const int part = task / tasks_per_part;
    int rest = task % tasks_per_part;
    const int hc = rest % pb.head_chunks;
    rest /= pb.head_chunks;
    attend(pb, rest / pb.Hkv, rest % pb.Hkv, hc, part, partial(task));
  };
  if (parallel) {
    pool.run(num_tasks, body);
  } else {
    for (int t = 0; t < num_tasks; ++t) body(t);
  }
  // Merge the partitions of each (sequence, head) and normalize.
  const int group = pb.Hq / pb.Hkv;
  std::vector<float> row(D), tmp(D);
  for (int unit = 0; unit < tasks_per_part; ++unit) {
    const int hc = unit % pb.head_chunks, bh = unit / pb.head_chunks;
    const int b = bh / pb.Hkv, h = bh % pb.Hkv;
    const int G = std::min(H, group - hc * H);
    for (int g = 0; g < G; ++g) {
      float m = -std::numeric_limits<float>::infinity();
      bool bad = false;  // a partition met an invalid block id
      for (int part = 0; part < pb.parts; ++part) {
        Partial st = partial(part * tasks_per_part + unit);
        m = std::max(m, st.m[g]);
        bad = bad || std::isnan(st.l[g]);
      }
      float l = bad ? std::numeric_limits<float>::quiet_NaN() : 0.0f;
      std::fill(row.begin(), row.end(), 0.0f);
      if (!bad && m != -std::numeric_limits<float>::infinity()) {
        for (int part = 0; part < pb.parts; ++part) {
          Partial st = partial(part * tasks_per_part + unit);
          if (st.l[g] == 0.0f) continue;
          const float w = std::exp(st.m[g] - m);
          l += st.l[g] * w;
          const float* acc = st.acc + size_t(g) * D;
          for (int d = 0; d < D; ++d) row[d] += acc[d] * w;
        }
      }
      const float inv = std::isnan(l) ? l : l > 0.0f ? 1.0f / l : 0.0f;
      for (int d = 0; d < D; ++d) row[d] *= inv;
      float* dst = out + (int64_t(b) * pb.Hq + h * group + hc * H + g) * D;
      if (pb.v.bits == 4) {
        unpermute4(row.data(), tmp.data(), D);
        std::copy(tmp.begin(), tmp.end(), dst);
      } else {
        std::copy(row.begin(), row.end(), dst);
      }
    }
  }
}


}  // namespace kvchat
