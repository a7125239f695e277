// Decode attention straight from the block-paged KV pool (one query per
// sequence), the contract of engine/model/attention for L == 1.
//
// One task per (sequence, KV head, head chunk, context partition): each K and V
// row is read once and used by every query head of its GQA group; an online
// softmax runs block by block (vectorized exp), and partitions of a long
// context are merged at the end (split-K), so one sequence still uses both
// cores. Quantized rows (mx.quantize, 4/8 bits) are dequantized as read.
#include "paged_decode_kernel.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <vector>

#include "paged_decode_quant.h"
#include "pool.h"

namespace kvchat {

namespace {

using namespace decode_task;

constexpr int64_t kParallelMinElements = 1 << 18;  // K/V elements read

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
    mask_folded(pb, b, q_head0, G, blk * BS, r0, r1, p, padded_bs);
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

}  // namespace

// A few positions of one sequence (speculative decoding's verify rows) folded into the
// heads take the decode kernel's split-K path, the K/V read once for all of them.
// (Prefill calls are not folded: a prompt's tail after a cached prefix must round as the
// same positions of a cold prefill, which the prefill kernel computes row by row alike;
// folded, a server test's warm logprobs moved by > 1e-4.)
// KVCHAT_FOLD_MAX sets the most positions folded (0: none), to compare the two paths.
int max_fold() {
  static const int n = [] {
    const char* env = std::getenv("KVCHAT_FOLD_MAX");
    return env ? std::max(0, std::atoi(env)) : 8;
  }();
  return n;
}

Problem fold_positions(const Problem& pb) {
  Problem f = pb;  // (B, Hq, L, D) queries and outputs are (B, Hq * L, 1, D) in memory
  f.fold = pb.L;
  f.Hq = pb.Hq * pb.L;
  f.L = 1;
  const int group = f.Hq / f.Hkv;
  const int chunks = (group + 7) / 8;  // the register-resident tasks take up to 8 heads
  f.heads_per_task = (group + chunks - 1) / chunks;
  f.head_chunks = (group + f.heads_per_task - 1) / f.heads_per_task;
  return f;
}

void run_problem(Problem pb, float* out /* (B, Hq, D) */) {
  // Waking a sleeping second thread costs 50-300 us on the 2-core build VMs,
  // but in a decode step the matmul just before has left it spinning: problems
  // from 2^18 K/V elements (~700 tokens of context for the default model, 3 KV
  // heads) split. Measured: 1x1024 f16 ~110 -> 83 us, 1x4096 266 -> 220 us; a
  // batch of 8 at 300 tokens had left a core idle.
  int64_t rows_read = 0;  // K and V rows of every (sequence, KV head)
  pb.parts = 1;
  for (int b = 0; b < pb.B; ++b) {
    const int seen = pb.lens[b] - pb.first_key(pb.lens[b] - 1);  // keys a window leaves
    rows_read += 2 * int64_t(seen) * pb.Hkv;
    pb.parts = std::max(pb.parts, partitions_of(pb, b));
  }
  auto& pool = ThreadPool::instance();
  const bool parallel = rows_read * pb.D >= kParallelMinElements && pool.size() > 1;
  // Split alike on one thread or many, whatever the batch: `partition_span`.
  const int tasks_per_part = pb.B * pb.Hkv * pb.head_chunks;
  const int num_tasks = tasks_per_part * pb.parts;
  const int H = pb.heads_per_task, D = pb.D;
  // Partial results of every task: m, l (H each) and acc (H x D), each written whole by
  // its task before the merge reads it: kept per thread and not zeroed (at a long context
  // and a large batch the fixed-size partitions make thousands of tasks).
  thread_local std::vector<float> kept;
  std::vector<float>& partials = kept;
  partials.resize(size_t(num_tasks) * H * (D + 2));
  auto partial = [&](int task) {
    float* base = partials.data() + size_t(task) * H * (D + 2);
    return Partial{base, base + H, base + 2 * H};
  };
  // A (partition, sequence, KV head)'s head chunks run on one thread, one after the other:
  // the first reads its K/V from memory, the others from this core's cache (split across
  // the cores, every chunk of a folded verify step read them from memory again).
  const int runs = num_tasks / pb.head_chunks;
  auto body = [&](int run) {
    const int part = run / (pb.B * pb.Hkv), bh = run % (pb.B * pb.Hkv);
    for (int hc = 0; hc < pb.head_chunks; ++hc)
      attend(pb, bh / pb.Hkv, bh % pb.Hkv, hc, part,
             partial(part * tasks_per_part + bh * pb.head_chunks + hc));
  };
  if (parallel) {
    pool.run(runs, body);
  } else {
    for (int r = 0; r < runs; ++r) body(r);
  }
  // Merge the partitions of each (sequence, head) and normalize.
  const int group = pb.Hq / pb.Hkv;
  std::vector<float> row(D), tmp(D);
  for (int unit = 0; unit < tasks_per_part; ++unit) {
    const int hc = unit % pb.head_chunks, bh = unit / pb.head_chunks;
    const int b = bh / pb.Hkv, h = bh % pb.Hkv;
    const int G = std::min(H, group - hc * H);
    for (int g = 0; g < G; ++g) {
      const int q_head = h * group + hc * H + g;
      merge_head(pb.parts, g, D, pb.sinks == nullptr ? nullptr : pb.sinks + q_head / pb.fold,
                 [&](int part) { return partial(part * tasks_per_part + unit); }, row.data());
      float* dst = out + (int64_t(b) * pb.Hq + q_head) * D;
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
