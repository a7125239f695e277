// The decode kernel of a residual-format pool (paged_residual.h).
//
// Keys of a full block are stored per channel (KIVI): k[t][d] = s[d] * c[d][t] + b[d], a
// channel's BS codes contiguous. So a block's scores are
//   q . k[t] = sum_d (q[d] * s[d]) * c[d][t] + sum_d q[d] * b[d]:
// one vector multiply-add of 16 tokens' codes per channel and head, no horizontal sum and
// no dequantized row. Values are per-token rows, dequantized as read. A block still
// residual is read exact from the side store: keys against the plain queries, and its
// weighted value sum taken into the quantized rows' space (times R, 4-bit element order)
// so one accumulator serves both; the merge maps it back.
//
// Each sequence's context splits into partitions by its own length only (never by the
// batch or the thread count), so a row computes alike alone and in any batch.
#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "kernels.h"
#include "paged_decode_qk.h"
#include "paged_decode_task.h"
#include "paged_residual_kernel.h"
#include "pool.h"

namespace kvchat {

namespace {

using decode_task::kSpan;
using decode_task::Partial;
using decode_task::softmax_block;

constexpr int kPartitionBlocks = 32;  // one partition per 32 blocks of a context
constexpr int kMaxParts = 8;
constexpr int64_t kParallelMinElements = 1 << 18;  // K/V elements read

float nan() {
  return std::numeric_limits<float>::quiet_NaN();
}

// The first position sequence b's decode row sees: 0, or where its window starts.
int first_seen(const ResidualProblem& pb, int b) {
  return pb.window > 0 ? std::max(0, pb.lens[b] - pb.window) : 0;
}

int parts_of(const ResidualProblem& pb, int b) {  // over the blocks from its window's first
  const int blocks = (pb.lens[b] + pb.BS - 1) / pb.BS - first_seen(pb, b) / pb.BS;
  return std::clamp((blocks + kPartitionBlocks - 1) / kPartitionBlocks, 1, kMaxParts);
}

// The quantized block after `blk` (if it is in [.., blk1) and in the pool) fetched into the
// cache ahead of use: its key codes, their channel scales and biases, and its value rows
// (`decode_task::prefetch_side`; KVCHAT_KV_PREFETCH=0 turns it off).
void prefetch_next(const ResidualProblem& pb, int b, int h, int blk, int blk1) {
  if (!prefetch_kv() || blk + 1 >= blk1) return;
  const int32_t phys = pb.tables[int64_t(b) * pb.table_width + blk + 1];
  if (phys < 0 || phys >= pb.num_blocks) return;
  const int64_t id = int64_t(h) * pb.num_blocks + phys;
  const int64_t codes = int64_t(pb.D) * pb.k_width, line = int64_t(pb.D) * elem_bytes(pb.k_elem);
  prefetch_range(pb.k_codes + id * codes, codes);
  for (const void* base : {pb.k_scales, pb.k_biases})
    prefetch_range(static_cast<const char*>(base) + id * line, line);
  prefetch_side(pb.v, id * pb.BS, pb.BS);
}

// One task: G query heads of KV head h over partition `part` of sequence b's blocks, the
// queries' channel products and the output accumulators in registers (D = NV * W).
template <int NV, int G>
void attend(const ResidualProblem& pb, int b, int h, int hc, int part, int parts, Partial st) {
  constexpr int D = NV * W;
  const int BS = pb.BS, group = pb.Hq / pb.Hkv;
  const int q_head0 = h * group + hc * pb.heads_per_task;
  const int len = pb.lens[b], blocks = (len + BS - 1) / BS;
  const int seen = first_seen(pb, b), first = seen / BS;  // a window skips the blocks before
  const int per_part = (blocks - first + parts - 1) / parts;
  const int blk0 = std::min(blocks, first + part * per_part), blk1 = std::min(blocks, blk0 + per_part);
  const float* qp = pb.q + (int64_t(b) * pb.Hq + q_head0) * D;
  const float* qk = pb.qk + (int64_t(b) * pb.Hq + q_head0) * D;
  // Quantized blocks in spans of up to kSpan, scored together and then normalized by one
  // online-softmax step (as the plain kernels do: its reductions, exp and rescale were paid
  // per 16 rows); the row's own exact block alone.
  const int stride = kSpan * BS;
  thread_local std::vector<float> scratch;
  scratch.resize(size_t(G) * (stride + D) + 3 * size_t(D));
  float* p = scratch.data();  // G x stride scores, then probabilities
  float* qs = p + size_t(G) * stride;  // G x D: queries times a block's channel scales
  float* row = qs + size_t(G) * D;
  float* tmp = row + D;
  float* moved = tmp + D;
  vf acc[G][NV];
  float m[G], l[G], bias[G][decode_task::kMaxKeyGroups] = {};  // quantized values' sum p b
  for (int g = 0; g < G; ++g) {
    m[g] = -std::numeric_limits<float>::infinity();
    l[g] = 0.0f;
    for (int j = 0; j < NV; ++j) acc[g][j] = vf{};
  }
  const int own = (len - 1) / BS;  // the row's own block: read exact, from the side store
  for (int blk = blk0; blk < blk1;) {
    int n = 0;  // the span: blocks blk .. blk + n - 1
    int64_t ids[kSpan];
    int32_t res = -1;
    while (n < kSpan && blk + n < blk1 && (n == 0 || blk + n != own)) {
      const int32_t phys = pb.tables[int64_t(b) * pb.table_width + blk + n];
      const int32_t mapped = phys >= 0 && phys < pb.num_blocks ? pb.res_map[phys] : pb.nres;
      if (mapped >= pb.nres) {  // an id outside the pool or the side store: report, never read
        for (int g = 0; g < G; ++g) st.l[g] = nan();
        return;
      }
      // the rule is by position: only the row's own block is exact. An earlier block still
      // mapped was filled this step by this row's sequence (a verify step's drafts) and is
      // quantized by this step's write, as plain decoding reads it.
      ids[n] = int64_t(h) * pb.num_blocks + phys;
      prefetch_next(pb, b, h, blk + n, blk1);
      if (blk + n++ == own) {
        res = mapped;
        break;
      }
    }
    const int r0 = std::max(0, seen - blk * BS), r1 = std::min(BS, len - (blk + n - 1) * BS);
    const int hi = (n - 1) * BS + r1;  // the span's scores: [r0, hi) of each head's row
    const int64_t res_row0 = (int64_t(h) * pb.nres + res) * BS;
    if (res >= 0) {
      for (int r = r0; r < r1; ++r) {
        vf k[NV];
        for (int j = 0; j < NV; ++j) k[j] = load_any(pb.res_k, pb.res_elem, (res_row0 + r) * D + j * W);
        for (int g = 0; g < G; ++g) {
          vf dot{};
          for (int j = 0; j < NV; ++j) dot += load(qp + size_t(g) * D + j * W) * k[j];
          p[size_t(g) * stride + r] = hsum(dot);
        }
      }
    } else {
      for (int i = 0; i < n; ++i) channel_scores<G>(pb, ids[i], qk, qs, p + i * BS, stride);
    }
    for (int g = 0; g < G; ++g) {
      const float alpha = softmax_block(p + size_t(g) * stride, r0, hi, m[g], l[g]);
      if (alpha != 1.0f) {
        for (int j = 0; j < NV; ++j) acc[g][j] = acc[g][j] * alpha;
        for (float& x : bias[g]) x *= alpha;
      }
    }
    blk += n;
    if (res >= 0) {  // sum p v over the exact rows, then into the stored space once a head
      vf sum[G][NV] = {};
      for (int r = r0; r < r1; ++r) {
        vf v[NV];
        for (int j = 0; j < NV; ++j) v[j] = load_any(pb.res_v, pb.res_elem, (res_row0 + r) * D + j * W);
        for (int g = 0; g < G; ++g) {
          const vf pr = splat(p[size_t(g) * stride + r]);
          for (int j = 0; j < NV; ++j) sum[g][j] = sum[g][j] + pr * v[j];
        }
      }
      for (int g = 0; g < G; ++g) {
        for (int j = 0; j < NV; ++j) store(row + j * W, sum[g][j]);
        const float* moved_row = stored_space(pb, row, tmp, moved);
        for (int j = 0; j < NV; ++j) acc[g][j] = acc[g][j] + load(moved_row + j * W);
      }
      continue;
    }
    for (int i = 0; i < n; ++i) {
      const int a = i == 0 ? r0 : 0, z = i == n - 1 ? r1 : BS;
      float* pi = p + i * BS;
      if constexpr (decode_task::kIntKeys) {  // (p s) v_int, the biases summed apart
        decode_task::value_block<NV, G>(pb.v, ids[i] * BS, a, z, pi, stride, acc, bias);
        continue;
      }
      for (int r = a; r < z; ++r) {
        vf v[NV];
        decode_task::load_row<NV>(pb.v, ids[i] * BS + r, v);
        for (int g = 0; g < G; ++g) {
          const vf pr = splat(pi[size_t(g) * stride + r]);
          for (int j = 0; j < NV; ++j) acc[g][j] = acc[g][j] + pr * v[j];
        }
      }
    }
  }
  if constexpr (decode_task::kIntKeys) decode_task::add_value_biases<NV, G>(pb.v, acc, bias);
  for (int g = 0; g < G; ++g) {
    st.m[g] = m[g];
    st.l[g] = l[g];
    for (int j = 0; j < NV; ++j) store(st.acc + size_t(g) * D + j * W, acc[g][j]);
  }
}

using AttendFn = void (*)(const ResidualProblem&, int, int, int, int, int, Partial);

template <int NV, int... Gs>
AttendFn pick_g(int G, std::integer_sequence<int, Gs...>) {
  AttendFn fn = nullptr;
  ((G == Gs + 1 ? (fn = &attend<NV, Gs + 1>, 0) : 0), ...);
  return fn;
}

// The kernel for this head dim and heads per task (nullptr: not built for them).
AttendFn pick(int D, int G) {
  const auto gs = std::make_integer_sequence<int, kResidualMaxHeads>{};
  switch (D) {
    case 64: return pick_g<4>(G, gs);
    case 128: return pick_g<8>(G, gs);
    default: return nullptr;
  }
}

struct Task {
  int b, h, hc, part, parts;
};

}  // namespace

// An exact value row (or a sum of them) in the quantized rows' space: times R, then
// 4-bit element order.
const float* stored_space(const ResidualProblem& pb, const float* x, float* tmp, float* out) {
  if (!pb.rotate_v && pb.v.bits != 4) return x;
  const float* src = x;
  if (pb.rotate_v) {
    hadamard_row(x, pb.v.bits == 4 ? tmp : out, pb.D, pb.signs, false);
    src = pb.v.bits == 4 ? tmp : out;
  }
  if (pb.v.bits == 4) permute4(src, out, pb.D);
  return out;
}

// A row of the stored value space back to a plain one: 4-bit element order undone, then
// times R^T (`stored_space`'s inverse).
void plain_space(const ResidualProblem& pb, const float* x, float* tmp, float* out) {
  if (pb.v.bits == 4) {
    unpermute4(x, tmp, pb.D);
    x = tmp;
  }
  if (pb.rotate_v)
    hadamard_row(x, out, pb.D, pb.signs, true);
  else
    std::copy_n(x, pb.D, out);
}

void run_residual_decode(const ResidualProblem& pb, float* out /* (B, Hq, D) */) {
  std::vector<Task> tasks;  // a sequence's partitions of one head chunk next to each other
  int64_t elements = 0;
  for (int b = 0; b < pb.B; ++b) {
    const int parts = parts_of(pb, b);
    for (int h = 0; h < pb.Hkv; ++h)
      for (int hc = 0; hc < pb.head_chunks; ++hc)
        for (int part = 0; part < parts; ++part) tasks.push_back({b, h, hc, part, parts});
    elements += 2 * int64_t(pb.lens[b]) * pb.Hkv * pb.D;
  }
  const int H = pb.heads_per_task, D = pb.D, n = int(tasks.size());
  std::vector<float> partials(size_t(n) * H * (D + 2));
  auto partial = [&](int t) {
    float* base = partials.data() + size_t(t) * H * (D + 2);
    return Partial{base, base + H, base + 2 * H};
  };
  auto body = [&](int t) {
    const Task& k = tasks[t];
    const int G = std::min(pb.heads_per_task, pb.Hq / pb.Hkv - k.hc * pb.heads_per_task);
    pick(pb.D, G)(pb, k.b, k.h, k.hc, k.part, k.parts, partial(t));
  };
  auto& pool = ThreadPool::instance();
  if (elements >= kParallelMinElements && pool.size() > 1)
    pool.run(n, body);
  else
    for (int t = 0; t < n; ++t) body(t);
  // Merge each (sequence, head)'s partitions in order, normalize, map back to plain rows.
  const int group = pb.Hq / pb.Hkv;
  std::vector<float> row(D), tmp(D);
  for (int t = 0; t < n; t += tasks[t].parts) {
    const Task& k = tasks[t];
    const int G = std::min(H, group - k.hc * H);
    for (int g = 0; g < G; ++g) {
      const int q_head = k.h * group + k.hc * H + g;
      decode_task::merge_head(k.parts, g, D, pb.sinks == nullptr ? nullptr : pb.sinks + q_head,
                              [&](int part) { return partial(t + part); }, row.data());
      plain_space(pb, row.data(), tmp.data(), out + (int64_t(k.b) * pb.Hq + q_head) * D);
    }
  }
}

}  // namespace kvchat
