// What the two tiled-matmul kernels share (built only with AVX-512 VNNI):
// qmm_tiled.cpp puts weight rows in the vector lanes (decode's few x rows),
// qmm_tiled_lanes.cpp puts x rows there (prefill).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "quant.h"

namespace kvchat::tiled {

constexpr int kTile = 16;  // weight rows per tile: one int32 lane each of the output

// x quantized per group: int16 values in natural k order, scale and float sum.
struct QuantX {
  std::vector<int16_t> q;  // M x K
  std::vector<float> scale;  // M x G: max |x| / 32767 of the group
  std::vector<float> sum;  // M x G
};

// max |x| and the float sum of one group of x (a multiple of 16 floats), as both x
// quantizers take them.
inline void group_stats(const float* src, int group, float& amax_out, float& sum_out) {
  __m512 amax = _mm512_setzero_ps(), total = _mm512_setzero_ps();
  for (int k = 0; k < group; k += 16) {
    const __m512 v = _mm512_loadu_ps(src + k);
    amax = _mm512_max_ps(amax, _mm512_abs_ps(v));
    total = _mm512_add_ps(total, v);
  }
  amax_out = _mm512_reduce_max_ps(amax);
  sum_out = _mm512_reduce_add_ps(total);
}

inline __m512 load_params(const void* base, Elem e, int64_t i) {
  return reinterpret_cast<__m512>(load_any(base, e, i));
}

// K-quant params (`QuantWeights::kquant`) at `base`: tile t's block of 8 groups from g on.
inline const uint8_t* kquant_block(const void* base, int G, int t, int g) {
  return static_cast<const uint8_t*>(base) + (int64_t(t) * (G / 8) + g / 8) * 160;
}

// The 16 rows' float16 steps of the block holding group g.
inline __m512 kquant_step(const void* base, int G, int t, int g) {
  return _mm512_cvtph_ps(
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kquant_block(base, G, t, g) + 128)));
}

// Group g's 16 values: code x step, rounded to float16 as the converter rounded d x sc
// (the same bits as its float16 scales and biases).
inline __m512 kquant_value(const void* base, int G, int t, int g, __m512 step) {
  const __m128i codes = _mm_loadu_si128(
      reinterpret_cast<const __m128i*>(kquant_block(base, G, t, g) + g % 8 * 16));
  const __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(codes)), step);
  return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}

inline __m512 kquant_params(const void* base, int G, int t, int g) {
  return kquant_value(base, G, t, g, kquant_step(base, G, t, g));
}

// Scales of tile t's group g (16 rows).
inline __m512 load_scales(const QuantWeights& q, int t, int g) {
  if (q.kquant) return kquant_params(q.scales, q.G, t, g);
  return load_params(q.scales, q.elem, (int64_t(t) * q.G + g) * kTile);
}

// Biases of tile t's group g, whose scales are S: stored, or bias_factor x S.
inline __m512 load_biases(const QuantWeights& q, int t, int g, __m512 S) {
  if (q.kquant) return kquant_params(q.biases, q.G, t, g);
  return q.biases ? load_params(q.biases, q.elem, (int64_t(t) * q.G + g) * kTile)
                  : _mm512_mul_ps(S, _mm512_set1_ps(q.bias_factor));
}

// Tile t's group g: its 16 rows x group weights (2 * group * bits bytes).
inline const uint8_t* tile_group(const QuantWeights& q, int t, int g) {
  return q.w + int64_t(t) * kTile * q.row_bytes() + int64_t(g) * q.group * 2 * q.bits;
}

// Quad j of tile-group `wg` as 16 rows x 4 weight bytes (byte 4i + b: row i). 4 bits:
// quads 2p and 2p + 1 share 64-byte block p, 2p in the low nibbles. 5 and 6 bits: block p
// is 16 x BITS bytes, the 64 nibble bytes of 4 bits, then per quad (2p, then 2p + 1) its
// bit planes above the nibble, 8 bytes each: bit 4i + b of plane h is bit 4 + h of byte
// 4i + b. A mask register widens a plane to bytes (GGUF Q5's codes stay exact in 5 bits,
// 6 bits where 8 held them).
template <int BITS>
inline __m512i quad_bytes(const uint8_t* wg, int j) {
  if constexpr (BITS == 8) {
    return _mm512_loadu_si512(wg + j * 64);
  } else {
    const uint8_t* block = wg + (j / 2) * 16 * BITS;
    const __m512i v = _mm512_loadu_si512(block);
    __m512i q = _mm512_and_si512(j % 2 ? _mm512_srli_epi16(v, 4) : v, _mm512_set1_epi8(0x0f));
    const uint8_t* planes = block + 64 + (j % 2) * 8 * (BITS - 4);
    for (int h = 0; h < BITS - 4; ++h) {
      uint64_t m;
      std::memcpy(&m, planes + 8 * h, 8);
      q = _mm512_or_si512(q, _mm512_maskz_mov_epi8(m, _mm512_set1_epi8(char(16 << h))));
    }
    return q;
  }
}

// f<BITS> for the tiled kernels' weight widths.
#define KVCHAT_BY_BITS(bits, f)                                                  \
  ((bits) == 4 ? f<4> : (bits) == 5 ? f<5> : (bits) == 6 ? f<6> : f<8>)

// One quad's 16 rows x 4 weights (bytes 4i..4i+3: row i) as words. Zero-extending
// bytes to words puts row r's weights in int32 lanes 2r, 2r + 1 of `lo` (rows 0-7)
// and `hi` (rows 8-15), two weights each; a broadcast qword of 4 int16 of x then
// lines up (x0, x1) with lane 2r and (x2, x3) with lane 2r + 1.
inline void widen(__m512i w, __m512i& lo, __m512i& hi) {
  lo = _mm512_cvtepu8_epi16(_mm512_castsi512_si256(w));
  hi = _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(w, 1));
}

constexpr int kLanes = 16;  // x rows per block of the lanes kernels

// The next tile's weights fetched into L2 while a tile computes (see `walk_lanes`);
// KVCHAT_LANES_PREFETCH=0 turns it off, to compare.
inline bool lanes_prefetch() {
  static const bool on = [] {
    const char* env = std::getenv("KVCHAT_LANES_PREFETCH");
    return !env || std::atoi(env) != 0;
  }();
  return on;
}

// The lanes kernels' walk over tiles t0..t1 (qmm_tiled_lanes.cpp, qmm_tiled_int8_lanes.cpp):
// `unpack(t)` lays tile t out, then `block(blk, v)` fills v[n] with output column 16t + n
// of x block blk's 16 rows, stored transposed as those rows' outputs. The next tile's
// weights are prefetched a few lines per block of x: unpacking a tile waited on DRAM for
// ~13 % of a 1B prefill (+5 % prefill tok/s, 3 interleaved runs).
template <class Unpack, class Block>
void walk_lanes(const QuantWeights& q, int64_t M, int t0, int t1, float* y, Unpack unpack,
                Block block) {
  const int64_t blocks = (M + kLanes - 1) / kLanes;
  const int64_t lines = kTile * q.row_bytes() / 64, per_block = (lines + blocks - 1) / blocks;
  for (int t = t0; t < t1; ++t) {
    unpack(t);
    const char* next = t + 1 < t1 && lanes_prefetch()
                           ? reinterpret_cast<const char*>(tile_group(q, t + 1, 0))
                           : nullptr;
    for (int64_t blk = 0; blk < blocks; ++blk) {
      if (next)
        for (int64_t l = blk * per_block; l < std::min(lines, (blk + 1) * per_block); ++l)
          _mm_prefetch(next + l * 64, _MM_HINT_T1);
      __m512 v[kTile];  // v[n]: output column 16t + n of the block's 16 rows
      block(blk, v);
      transpose16(reinterpret_cast<vf*>(v));  // v[lane]: row 16 blk + lane's 16 outputs
      for (int lane = 0; lane < kLanes && blk * kLanes + lane < M; ++lane)
        _mm512_storeu_ps(y + (blk * kLanes + lane) * q.N + int64_t(t) * kTile, v[lane]);
    }
  }
}

// y (M x N) for x quantized in `qx`, x rows in the lanes (qmm_tiled_lanes.cpp);
// `tasks` runs of tiles on the pool (1: the calling thread alone).
void qmm_lanes(const QuantWeights& q, const QuantX& qx, int64_t M, float* y, int tasks);

// Task `task`'s tiles [t0, t1) of `tiles` split over `tasks`: the first tiles % tasks tasks
// take one more. Tasks are claimed in order as threads free up, so the larger go first:
// ceil-sized runs left 36 tiles (576 outputs) as 7 x 5 + 1, one thread 20, the other 16.
inline void task_tiles(int tiles, int tasks, int task, int& t0, int& t1) {
  const int base = tiles / tasks, extra = tiles % tasks;
  t0 = task * base + std::min(task, extra);
  t1 = t0 + base + (task < extra ? 1 : 0);
}

// How qmm_tiled splits one product: tasks over tiles, over x rows, which kernel, and
// how far ahead the rows kernel prefetches.
struct Plan {
  int tasks;
  int64_t x_tasks;
  bool lanes;
  int64_t prefetch;
};

// y (M x N) with x quantized to int8 per group (qmm_tiled_int8.cpp).
void qmm_int8(const QuantWeights& q, const float* x, int64_t M, float* y, const Plan& plan);

}  // namespace kvchat::tiled
