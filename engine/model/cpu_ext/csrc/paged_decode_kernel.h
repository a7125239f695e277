// The paged decode attention kernel (see paged_decode_kernel.cpp) and the
// description of one problem it solves.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>

#include "simd.h"

namespace kvchat {

constexpr int kMaxHeadsPerTask = 16;  // query heads sharing one pass over K/V

// One side (K or V) of the pool: float rows or packed rows + scales/biases.
struct Side {
  const char* data;
  Elem elem;  // float rows
  int bits;  // 0: float rows
  int group;
  const void* scales;
  const void* biases;
  Elem scale_elem;
  int D;
  int64_t row_bytes;

  // Row `row` (in pool order) as D floats; 4-bit rows come out in the
  // (evens, odds) order of each 32-chunk. May return a pointer into the pool.
  const float* row(int64_t row, float* buf) const {
    if (bits == 0) {
      if (elem == Elem::f32) return reinterpret_cast<const float*>(data) + row * D;
      for (int d = 0; d < D; d += W) store(buf + d, load_any(data, elem, row * D + d));
      return buf;
    }
    dequantize(row, D, [buf](int d, vf v) { store(buf + d, v); });
    return buf;
  }

  // A quantized row of `dims` elements, W at a time: put(d, values of d..d+W), in
  // `row`'s order. The register-resident kernel puts them in registers, `row` in memory.
  template <class Put>
  void dequantize(int64_t row, int dims, Put put) const {
    const uint8_t* p = reinterpret_cast<const uint8_t*>(data) + row * row_bytes;
    const int groups = dims / group;
    for (int g = 0; g < groups; ++g) {
      const vf S = splat(scalar_any(scales, scale_elem, row * groups + g));
      const vf B = splat(scalar_any(biases, scale_elem, row * groups + g));
      for (int d = g * group; d < (g + 1) * group; d += 32) {
        vb raw0, raw1;
        if (bits == 4) {
          std::memcpy(&raw1, p + d / 2, 16);
          nibbles(raw1, raw0, raw1);
        } else {
          std::memcpy(&raw0, p + d, 16);
          std::memcpy(&raw1, p + d + 16, 16);
        }
        put(d, bytes_to_float(raw0) * S + B);
        put(d + W, bytes_to_float(raw1) * S + B);
      }
    }
  }
};

// (evens, odds) order of each 32-chunk <-> natural order: the order in which
// Side::row hands out 4-bit rows.
inline void permute4(const float* src, float* dst, int D) {
  for (int d = 0; d < D; d += 32)
    for (int i = 0; i < 16; ++i) {
      dst[d + i] = src[d + 2 * i];
      dst[d + 16 + i] = src[d + 2 * i + 1];
    }
}

inline void unpermute4(const float* src, float* dst, int D) {
  for (int d = 0; d < D; d += 32)
    for (int i = 0; i < 16; ++i) {
      dst[d + 2 * i] = src[d + i];
      dst[d + 2 * i + 1] = src[d + 16 + i];
    }
}

// One paged-attention call: queries, the pool sides, tables and lengths.
struct Problem {
  const float* q;  // (B, Hq, L, D), unscaled
  Side k, v;
  const int32_t* tables;
  int64_t table_width;
  const int32_t* lens;
  int B, Hq, Hkv, D, BS, num_blocks;
  int L;  // queries per sequence: the L newest positions (1 for decode)
  float scale;
  int heads_per_task, head_chunks;
  int parts;  // context partitions (split-K); set by run_problem
  int window;  // a sliding window: each query sees its last `window` positions (0: all)
  const float* sinks;  // (Hq / fold,) logits joining each head's softmax without a value, or null
  // Query positions folded into the heads (`fold_positions`): query head v is head v / fold
  // at position v % fold of the fold newest, and sees the keys up to its own position.
  int fold = 1;

  // First key position a query at position `pos` sees.
  int first_key(int pos) const {
    return window > 0 && pos + 1 > window ? pos + 1 - window : 0;
  }
  // exp(sink - m): what a head's sink adds to a softmax whose running max is m.
  float sink_weight(int q_head, float m) const;
  // Keys [0, visible_end(b, q_head)) are visible to (folded) query head q_head of sequence b.
  int visible_end(int b, int q_head) const {
    return lens[b] - (fold - 1 - q_head % fold);
  }
};

inline float Problem::sink_weight(int q_head, float m) const {
  return sinks == nullptr ? 0.0f : std::exp(sinks[q_head / fold] - m);
}

// First pool row of sequence b's logical block blk for KV head h; -1 for a block
// id outside the pool. Never read outside it: the caller reports a NaN row (an
// exception cannot leave a dispatched task: MLX would abort the process).
inline int64_t block_row0(const Problem& pb, int b, int h, int blk) {
  const int32_t phys = pb.tables[int64_t(b) * pb.table_width + blk];
  if (phys < 0 || phys >= pb.num_blocks) return -1;
  return (int64_t(h) * pb.num_blocks + phys) * pb.BS;
}

// Block blk + 1 of sequence b, KV head h, fetched into the cache ahead of use when it lies
// before token t1: at a long context the pool streams from DRAM, and the quantized loops
// (more work per byte) left too few loads in flight to hide its latency (in the engine at
// 4k, ~2x their time over an L2-resident pool).
inline int elem_bytes(Elem e) {
  return e == Elem::f32 ? 4 : 2;
}

// `bytes` from p on, one cache line at a time (a prefetch never faults).
inline void prefetch_range(const void* p, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(static_cast<const char*>(p) + o);
}

inline void prefetch_side(const Side& s, int64_t row, int rows) {
  const int64_t bytes = s.bits ? s.row_bytes : int64_t(s.D) * elem_bytes(s.elem);
  prefetch_range(s.data + row * bytes, rows * bytes);
  if (s.bits) {  // the rows' scales and biases: contiguous, (row, group) ordered
    const int64_t line = int64_t(s.D / s.group) * elem_bytes(s.scale_elem);
    for (const void* base : {s.scales, s.biases})
      prefetch_range(static_cast<const char*>(base) + row * line, rows * line);
  }
}

// False when KVCHAT_KV_PREFETCH=0 (to measure without it).
inline bool prefetch_kv() {
  static const bool on = [] {
    const char* env = std::getenv("KVCHAT_KV_PREFETCH");
    return !(env && env[0] == '0');
  }();
  return on;
}

// Block blk + ahead's K and V rows on their way to the cache (none past t1).
inline void prefetch_next_block(const Problem& pb, int b, int h, int blk, int t1,
                                int ahead = 1) {
  if (!prefetch_kv() || (blk + ahead) * pb.BS >= t1) return;
  const int64_t row = block_row0(pb, b, h, blk + ahead);
  if (row < 0) return;
  prefetch_side(pb.k, row, pb.BS);
  prefetch_side(pb.v, row, pb.BS);
}

// Decode (L == 1): attention of every (sequence, query head) into out (B, Hq, D),
// float32 (paged_decode_kernel.cpp).
void run_problem(Problem pb, float* out);

// Prefill (L >= 1, causal): out (B, Hq, L, D), float32 (paged_prefill_kernel.cpp).
void run_prefill(const Problem& pb, float* out);

// The most positions `fold_positions` folds (KVCHAT_FOLD_MAX; 0: none), and the problem
// a causal problem of L positions without a window becomes with them folded into the heads.
int max_fold();
Problem fold_positions(const Problem& pb);


}  // namespace kvchat
