// A pool side's rows read into registers, and the scores of 16 key rows at once: the pieces
// of a decode task (paged_decode_task.h) that touch K and V rows.
#pragma once

#include "hsums.h"
#include "paged_decode_kernel.h"

namespace kvchat::decode_task {

// Row `row` of one pool side (D = NV * W floats) in registers: float rows converted as
// loaded, quantized rows dequantized exactly as `Side::row` does (4-bit rows in its
// (evens, odds) order of each 32-chunk), without the round trip through memory.
template <int NV>
__attribute__((always_inline)) inline void load_row(const Side& side, int64_t row, vf* out) {
  if (side.bits == 0) {
    const int64_t base = row * NV * W;
    for (int j = 0; j < NV; ++j) out[j] = load_any(side.data, side.elem, base + j * W);
    return;
  }
  side.dequantize(row, NV * W, [out](int d, vf v) { out[d / W] = v; });
}

#if defined(__AVX512F__)
// The scores of key rows row..row + 15 for the G queries, into out[g * stride + 0..15]:
// the dot products exactly as the row-by-row loop makes them, reduced key by key
// (`key_sums16`, the same bits as `hsums`) and stored a vector per query.
template <int NV, int G>
__attribute__((always_inline)) inline void scores16(const Side& k_side, int64_t row,
                                                    const vf (*q)[NV], float* out,
                                                    int stride) {
  __m512 pairs[G][8];  // each query's keys halved in pairs (`key_pair`)
  for (int pr = 0; pr < 8; ++pr) {
    vf ka[NV], kb[NV];
    load_row<NV>(k_side, row + 2 * pr, ka);
    load_row<NV>(k_side, row + 2 * pr + 1, kb);
    for (int g = 0; g < G; ++g) {
      vf da{}, db{};
      for (int j = 0; j < NV; ++j) {
        da += q[g][j] * ka[j];
        db += q[g][j] * kb[j];
      }
      pairs[g][pr] = key_pair(da, db);
    }
  }
  for (int g = 0; g < G; ++g) _mm512_storeu_ps(out + size_t(g) * stride, key_sums16(pairs[g]));
}

constexpr bool kScores16 = true;
#else
constexpr bool kScores16 = false;  // never called: callers score row by row

template <int NV, int G>
inline void scores16(const Side&, int64_t, const vf (*)[NV], float*, int) {}
#endif

}  // namespace kvchat::decode_task
