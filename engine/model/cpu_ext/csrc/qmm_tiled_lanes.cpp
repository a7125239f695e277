// The tiled matmul with x rows in the vector lanes: the kernel for many x rows
// (prefill; qmm_tiled.cpp picks it from ~14 rows).
//
// tile_rows spends ~10 shuffles, adds and scalings per 8 vpdpwssd (a group of
// 32 weights for one x row) turning lane pairs into rows. With 16 x rows in the
// lanes instead, each vpdpwssd takes one weight pair broadcast from memory
// against 16 rows' x pairs, its int32 lanes already are the rows' group sums,
// and a weight row's group costs 4 float instructions after its 16 vpdpwssd.
// Same integer sums and the same float operations in the same order per
// output as tile_rows, so the same results (tests check bit equality).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include "qmm_tiled_impl.h"

#include <algorithm>

#include "pool.h"

namespace kvchat::tiled {

namespace {

// x of 16-row blocks: (block, g, pair, lane) int16 pairs; (block, g, lane) scale and sum.
struct LaneX {
  std::vector<int32_t> q;
  std::vector<float> scale, sum;
};

void lane_layout(const QuantX& qx, int64_t M, int K, int G, int64_t b0, int64_t b1,
                 LaneX& lx) {
  const int pairs = K / 2;
  const int32_t* src = reinterpret_cast<const int32_t*>(qx.q.data());
  for (int64_t b = b0; b < b1; ++b) {
    int32_t* dst = lx.q.data() + b * pairs * kLanes;
    float *sc = lx.scale.data() + b * G * kLanes, *su = lx.sum.data() + b * G * kLanes;
    for (int lane = 0; lane < kLanes; ++lane) {
      const int64_t m = b * kLanes + lane;
      if (m >= M) {  // padding rows: zero x, zero scale and sum
        for (int p = 0; p < pairs; ++p) dst[int64_t(p) * kLanes + lane] = 0;
        for (int g = 0; g < G; ++g) sc[g * kLanes + lane] = su[g * kLanes + lane] = 0.0f;
        continue;
      }
      const int32_t* row = src + m * pairs;
      for (int p = 0; p < pairs; ++p) dst[int64_t(p) * kLanes + lane] = row[p];
      for (int g = 0; g < G; ++g) {
        sc[g * kLanes + lane] = qx.scale[m * G + g];
        su[g * kLanes + lane] = qx.sum[m * G + g];
      }
    }
  }
}

// Tile t's weights as int16 pairs: for group g and quad j, 32 int32: rows 0-7
// (two pairs each, as `widen` leaves them), then rows 8-15. Scales and biases as floats.
template <int BITS>
void unpack_tile(const QuantWeights& q, int t, int32_t* wp, float* s, float* b) {
  const int quads = q.group / 4;
  for (int g = 0; g < q.G; ++g) {
    const uint8_t* wg = tile_group(q, t, g);
    for (int j = 0; j < quads; ++j) {
      __m512i lo, hi;
      widen(quad_bytes<BITS>(wg, j), lo, hi);
      int32_t* dst = wp + (int64_t(g) * quads + j) * 2 * kTile;
      _mm512_storeu_si512(dst, lo);
      _mm512_storeu_si512(dst + kTile, hi);
    }
    const __m512 S = load_scales(q, t, g);
    _mm512_storeu_ps(s + g * kTile, S);
    _mm512_storeu_ps(b + g * kTile, load_biases(q, t, g, S));
  }
}

// acc += x . (the int16 pair at w, broadcast): the broadcast as vpdpwssd's memory
// operand ({1to16}); GCC otherwise loads each into a register of its own and then
// runs out of registers for the 16 accumulators.
inline void dpwssd_bcast(__m512i& acc, __m512i x, const int32_t* w) {
  asm("vpdpwssd %[w]%{1to16%}, %[x], %[acc]" : [acc] "+v"(acc) : [x] "v"(x), [w] "m"(*w));
}

// Tile t's 16 output columns for the 16 x rows of block `blk`: out[n] is column 16t + n.
void tile_lanes(const QuantWeights& q, const LaneX& lx, int64_t blk, const int32_t* wp,
                const float* s, const float* b, __m512* out) {
  const int G = q.G, quads = q.group / 4;
  __m512 acc[kTile];
  for (int n = 0; n < kTile; ++n) acc[n] = _mm512_setzero_ps();
  const int32_t* xg = lx.q.data() + blk * int64_t(G) * (q.group / 2) * kLanes;
  const int32_t* w = wp;  // quad j of group g: rows 0-7 at w, rows 8-15 at w + 16
  for (int g = 0; g < G; ++g) {
    __m512i isum[kTile];
#pragma GCC unroll 16
    for (int n = 0; n < kTile; ++n) isum[n] = _mm512_setzero_si512();
    for (int j = 0; j < quads; ++j, w += 2 * kTile, xg += 2 * kLanes) {
#pragma GCC unroll 2
      for (int half = 0; half < 2; ++half) {  // pairs 2j and 2j + 1 of the group
        const __m512i x = _mm512_loadu_si512(xg + half * kLanes);
#pragma GCC unroll 16
        for (int n = 0; n < kTile; ++n)
          dpwssd_bcast(isum[n], x, w + (n / 8) * kTile + 2 * (n % 8) + half);
      }
    }
    const __m512 dx = _mm512_loadu_ps(lx.scale.data() + (blk * G + g) * kLanes);
    const __m512 xs = _mm512_loadu_ps(lx.sum.data() + (blk * G + g) * kLanes);
#pragma GCC unroll 16
    for (int n = 0; n < kTile; ++n) {
      const __m512 f = _mm512_cvtepi32_ps(isum[n]);
      acc[n] = _mm512_fmadd_ps(f, _mm512_mul_ps(_mm512_set1_ps(s[g * kTile + n]), dx), acc[n]);
      acc[n] = _mm512_fmadd_ps(_mm512_set1_ps(b[g * kTile + n]), xs, acc[n]);
    }
  }
  for (int n = 0; n < kTile; ++n) out[n] = acc[n];
}

template <int BITS>
void tiles_lanes(const QuantWeights& q, const LaneX& lx, int64_t M, int t0, int t1, float* y) {
  const int G = q.G, quads = q.group / 4;
  thread_local std::vector<int32_t> wbuf;
  thread_local std::vector<float> sbuf, bbuf;
  wbuf.resize(size_t(G) * quads * 2 * kTile);
  sbuf.resize(size_t(G) * kTile);
  bbuf.resize(size_t(G) * kTile);
  walk_lanes(
      q, M, t0, t1, y,
      [&](int t) { unpack_tile<BITS>(q, t, wbuf.data(), sbuf.data(), bbuf.data()); },
      [&](int64_t blk, __m512* v) {
        tile_lanes(q, lx, blk, wbuf.data(), sbuf.data(), bbuf.data(), v);
      });
}

}  // namespace

void qmm_lanes(const QuantWeights& q, const QuantX& qx, int64_t M, float* y, int tasks) {
  auto& pool = ThreadPool::instance();
  const int tiles = q.N / kTile;
  const int64_t blocks = (M + kLanes - 1) / kLanes;
  thread_local LaneX kept;  // reused: see qmm_tiled
  LaneX& lx = kept;
  lx.q.resize(blocks * (q.K / 2) * kLanes);
  lx.scale.resize(blocks * q.G * kLanes);
  lx.sum.resize(blocks * q.G * kLanes);
  const int64_t b_tasks = tasks > 1 ? std::min<int64_t>(blocks, 8) : 1;
  const int64_t b_per = (blocks + b_tasks - 1) / b_tasks;
  pool.run(int(b_tasks), [&](int i) {
    lane_layout(qx, M, q.K, q.G, i * b_per, std::min(blocks, (i + 1) * b_per), lx);
  });
  pool.run(tasks, [&](int task) {
    int t0, t1;
    task_tiles(tiles, tasks, task, t0, t1);
    KVCHAT_BY_BITS(q.bits, tiles_lanes)(q, lx, M, t0, t1, y);
  });
}

}  // namespace kvchat::tiled

#endif
