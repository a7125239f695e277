// What the two tiled-matmul kernels share (built only with AVX-512 VNNI):
// qmm_tiled.cpp puts weight rows in the vector lanes (decode's few x rows),
// qmm_tiled_lanes.cpp puts x rows there (prefill).
#pragma once

#include <immintrin.h>

#include <cstdint>
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

inline __m512 load_params(const void* base, Elem e, int64_t i) {
  return reinterpret_cast<__m512>(load_any(base, e, i));
}

// Biases of the 16 rows at params index i, whose scales are S: stored, or bias_factor x S.
inline __m512 load_biases(const QuantWeights& q, int64_t i, __m512 S) {
  return q.biases ? load_params(q.biases, q.elem, i) : _mm512_mul_ps(S, _mm512_set1_ps(q.bias_factor));
}

// Tile t's group g: its 16 rows x group weights (2 * group * bits bytes).
inline const uint8_t* tile_group(const QuantWeights& q, int t, int g) {
  return q.w + int64_t(t) * kTile * q.row_bytes() + int64_t(g) * q.group * 2 * q.bits;
}

// Quad j of tile-group `wg` as 16 rows x 4 weight bytes (byte 4i + b: row i). 4 bits:
// quads 2p and 2p + 1 share 64-byte block p, 2p in the low nibbles.
template <int BITS>
inline __m512i quad_bytes(const uint8_t* wg, int j) {
  if constexpr (BITS == 4) {
    const __m512i v = _mm512_loadu_si512(wg + (j / 2) * 64);
    return _mm512_and_si512(j % 2 ? _mm512_srli_epi16(v, 4) : v, _mm512_set1_epi8(0x0f));
  } else {
    return _mm512_loadu_si512(wg + j * 64);
  }
}

// One quad's 16 rows x 4 weights (bytes 4i..4i+3: row i) as words. Zero-extending
// bytes to words puts row r's weights in int32 lanes 2r, 2r + 1 of `lo` (rows 0-7)
// and `hi` (rows 8-15), two weights each; a broadcast qword of 4 int16 of x then
// lines up (x0, x1) with lane 2r and (x2, x3) with lane 2r + 1.
inline void widen(__m512i w, __m512i& lo, __m512i& hi) {
  lo = _mm512_cvtepu8_epi16(_mm512_castsi512_si256(w));
  hi = _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(w, 1));
}

// y (M x N) for x quantized in `qx`, x rows in the lanes (qmm_tiled_lanes.cpp);
// `tasks` runs of tiles on the pool (1: the calling thread alone).
void qmm_lanes(const QuantWeights& q, const QuantX& qx, int64_t M, float* y, int tasks);

}  // namespace kvchat::tiled
