// The int8-activation tiled matmul's lanes kernel (prefill's many x rows; see
// qmm_tiled_int8.cpp): x rows in the vector lanes as unsigned bytes (x + 128), a weight
// row's 4 bytes the broadcast signed operand of each vpdpbusd.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <algorithm>

#include "pool.h"
#include "qmm_tiled_int8.h"

namespace kvchat::tiled {

namespace {

// x of 16-row blocks: (block, quad, lane) 4 bytes of x + 128; (block, g, lane) scale,
// sum, and `x_factor` x the int8 sum: what 8-bit weights' - 128 (x_factor 128) and a
// bias factor (`int_bias`) add to each dot.
struct LaneX8 {
  std::vector<uint32_t> q;
  std::vector<float> scale, sum;
  std::vector<int32_t> qcorr;
  int x_factor = 0;  // 0: no correction
};

void lane_layout8(const QuantX8& qx, int64_t M, int K, int G, int64_t b0, int64_t b1,
                  LaneX8& lx) {
  const int quads = K / 4;
  const uint32_t* src = reinterpret_cast<const uint32_t*>(qx.q.data());
  for (int64_t b = b0; b < b1; ++b) {
    uint32_t* dst = lx.q.data() + b * quads * kLanes;
    const int64_t p0 = b * G * kLanes;
    for (int lane = 0; lane < kLanes; ++lane) {
      const int64_t m = b * kLanes + lane;
      const bool pad = m >= M;  // padding rows: x 0, zero scale and sums
      for (int j = 0; j < quads; ++j)  // x + 128 per byte: the sign bit flipped
        dst[int64_t(j) * kLanes + lane] = pad ? 0x80808080u : src[m * quads + j] ^ 0x80808080u;
      for (int g = 0; g < G; ++g) {
        lx.scale[p0 + g * kLanes + lane] = pad ? 0.0f : qx.scale[m * G + g];
        lx.sum[p0 + g * kLanes + lane] = pad ? 0.0f : qx.sum[m * G + g];
        lx.qcorr[p0 + g * kLanes + lane] = pad ? 0 : lx.x_factor * qx.qsum[m * G + g];
      }
    }
  }
}

// Tile t's weights as signed bytes (8 bits: code - 128), quad j of group g's 16 row
// dwords at wp + (g * quads + j) * 16; per group and row the correction the offsets
// leave (- 128 x the codes' sum, + 128 x 128 x group for 8 bits); scales and biases.
template <int BITS>
void unpack8(const QuantWeights& q, int t, int32_t* wp, int32_t* corr, float* s, float* b) {
  const int quads = q.group / 4;
  const __m512i ones = _mm512_set1_epi8(1), flip = _mm512_set1_epi8(char(0x80));
  for (int g = 0; g < q.G; ++g) {
    const uint8_t* wg = tile_group(q, t, g);
    __m512i codes = _mm512_setzero_si512();
    for (int j = 0; j < quads; ++j) {
      const __m512i v = quad_bytes<BITS>(wg, j);
      codes = _mm512_dpbusd_epi32(codes, v, ones);  // each row's sum of codes
      _mm512_storeu_si512(wp + (int64_t(g) * quads + j) * kTile,
                          BITS == 8 ? _mm512_xor_si512(v, flip) : v);
    }
    __m512i c = _mm512_mullo_epi32(codes, _mm512_set1_epi32(-128));
    if (BITS == 8) c = _mm512_add_epi32(c, _mm512_set1_epi32(128 * 128 * q.group));
    _mm512_storeu_si512(corr + g * kTile, c);
    const __m512 S = load_scales(q, t, g);
    _mm512_storeu_ps(s + g * kTile, S);
    _mm512_storeu_ps(b + g * kTile, load_biases(q, t, g, S));
  }
}

// acc += x . (the signed bytes at w, broadcast); see qmm_tiled_lanes.cpp's dpwssd_bcast.
inline void dpbusd_bcast(__m512i& acc, __m512i x, const int32_t* w) {
  asm("vpdpbusd %[w]%{1to16%}, %[x], %[acc]" : [acc] "+v"(acc) : [x] "v"(x), [w] "m"(*w));
}

// Output columns 16t + n0 .. 16t + n0 + 7 for the 16 x rows of block `blk` (out[n]:
// column 16t + n0 + n). Half a tile per pass: 16 integer and 16 float accumulators
// spilled to the stack, and their stores and reloads cost ~10 % of the kernel.
template <int BITS, bool IB>
void lanes8_half(const QuantWeights& q, const LaneX8& lx, int64_t blk, int n0, const int32_t* wp,
                 const int32_t* corr, const float* s, const float* b, __m512* out) {
  constexpr int kHalf = kTile / 2;
  const int G = q.G, quads = q.group / 4;
  __m512 acc[kHalf];
  for (int n = 0; n < kHalf; ++n) acc[n] = _mm512_setzero_ps();
  const uint32_t* xg = lx.q.data() + blk * int64_t(G) * quads * kLanes;
  const int32_t* w = wp + n0;
  for (int g = 0; g < G; ++g) {
    const int gn = g * kTile + n0;
    __m512i isum[kHalf];
#pragma GCC unroll 8
    for (int n = 0; n < kHalf; ++n) isum[n] = _mm512_set1_epi32(corr[gn + n]);
    if (lx.x_factor != 0) {
      const __m512i qc = _mm512_loadu_si512(lx.qcorr.data() + (blk * G + g) * kLanes);
#pragma GCC unroll 8
      for (int n = 0; n < kHalf; ++n) isum[n] = _mm512_add_epi32(isum[n], qc);
    }
    for (int j = 0; j < quads; ++j, w += kTile, xg += kLanes) {
      const __m512i x = _mm512_loadu_si512(xg);
#pragma GCC unroll 8
      for (int n = 0; n < kHalf; ++n) dpbusd_bcast(isum[n], x, w + n);
    }
    const __m512 dx = _mm512_loadu_ps(lx.scale.data() + (blk * G + g) * kLanes);
    const __m512 xs = _mm512_loadu_ps(lx.sum.data() + (blk * G + g) * kLanes);
#pragma GCC unroll 8
    for (int n = 0; n < kHalf; ++n)
      acc[n] = finish<IB>(acc[n], isum[n], _mm512_mul_ps(_mm512_set1_ps(s[gn + n]), dx),
                          _mm512_set1_ps(b[gn + n]), xs);
  }
  for (int n = 0; n < kHalf; ++n) out[n] = acc[n];
}

template <int BITS, bool IB>
void lanes8(const QuantWeights& q, const LaneX8& lx, int64_t M, int t0, int t1, float* y) {
  const int G = q.G, quads = q.group / 4;
  thread_local std::vector<int32_t> wbuf, cbuf;
  thread_local std::vector<float> sbuf, bbuf;
  wbuf.resize(size_t(G) * quads * kTile);
  cbuf.resize(size_t(G) * kTile);
  sbuf.resize(size_t(G) * kTile);
  bbuf.resize(size_t(G) * kTile);
  walk_lanes(
      q, M, t0, t1, y,
      [&](int t) { unpack8<BITS>(q, t, wbuf.data(), cbuf.data(), sbuf.data(), bbuf.data()); },
      [&](int64_t blk, __m512* v) {
        for (int n0 = 0; n0 < kTile; n0 += kTile / 2)
          lanes8_half<BITS, IB>(q, lx, blk, n0, wbuf.data(), cbuf.data(), sbuf.data(),
                                bbuf.data(), v + n0);
      });
}

// KVCHAT_BY_BITS takes one template argument: the bias forms spelled out.
template <int BITS>
void lanes8_ib(const QuantWeights& q, const LaneX8& lx, int64_t M, int t0, int t1, float* y) {
  lanes8<BITS, true>(q, lx, M, t0, t1, y);
}
template <int BITS>
void lanes8_f(const QuantWeights& q, const LaneX8& lx, int64_t M, int t0, int t1, float* y) {
  lanes8<BITS, false>(q, lx, M, t0, t1, y);
}

}  // namespace

void qmm_int8_lanes(const QuantWeights& q, const QuantX8& qx, int64_t M, float* y, int tasks,
                    bool ib) {
  auto& pool = ThreadPool::instance();
  const int tiles = q.N / kTile;
  const int64_t blocks = (M + kLanes - 1) / kLanes;
  thread_local LaneX8 lanes_kept;
  LaneX8& lx = lanes_kept;
  lx.q.resize(blocks * (q.K / 4) * kLanes);
  lx.scale.resize(blocks * q.G * kLanes);
  lx.sum.resize(blocks * q.G * kLanes);
  lx.qcorr.resize(blocks * q.G * kLanes);
  lx.x_factor = (q.bits == 8 ? 128 : 0) + (ib ? int_bias(q) : 0);
  const int64_t b_tasks = tasks > 1 ? std::min<int64_t>(blocks, 8) : 1;
  const int64_t b_per = (blocks + b_tasks - 1) / b_tasks;
  pool.run(int(b_tasks), [&](int i) {
    lane_layout8(qx, M, q.K, q.G, i * b_per, std::min(blocks, (i + 1) * b_per), lx);
  });
  pool.run(tasks, [&](int task) {
    int t0, t1;
    task_tiles(tiles, tasks, task, t0, t1);
    ib ? KVCHAT_BY_BITS(q.bits, lanes8_ib)(q, lx, M, t0, t1, y)
       : KVCHAT_BY_BITS(q.bits, lanes8_f)(q, lx, M, t0, t1, y);
  });
}

}  // namespace kvchat::tiled

#endif
