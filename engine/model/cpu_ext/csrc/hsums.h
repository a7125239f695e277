// Several horizontal sums at once: the scores of one key row against the G query heads
// of a decode task. One `hsum` per head costs ~8 shuffles and adds for one lane of
// result; reducing the G vectors together (a transpose-and-add tree) costs ~3 per head.
// The sums are the same values added in another order (last bits differ from `hsum`).
#pragma once

#include "simd.h"

namespace kvchat {

#if defined(__AVX512F__)
namespace hsums_detail {

// Chunks (4 lanes) 0-1 summed with 2-3 for a and b: [a's 8 partial lanes, b's 8].
inline __m512 halve(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
}

// Two `halve` results -> one chunk per head, heads [a0, a1, b0, b1] (4 lanes each).
inline __m512 quarter(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
}

}  // namespace hsums_detail
#endif

// out[g] = the sum of d[g]'s lanes, g < G (G <= 8).
template <int G>
__attribute__((always_inline)) inline void hsums(const vf* d, float* out) {
  static_assert(G >= 1 && G <= 8, "hsums: 1 to 8 vectors");
#if defined(__AVX512F__)
  using namespace hsums_detail;
  if constexpr (G == 1) {
    out[0] = hsum(d[0]);
  } else {
    __m512 x[8];
    for (int g = 0; g < 8; ++g)
      x[g] = g < G ? reinterpret_cast<__m512>(d[g]) : _mm512_setzero_ps();
    const __m512 h01 = halve(x[0], x[1]), h23 = halve(x[2], x[3]);
    __m512 q = quarter(h01, h23);  // chunk c: head c's 4 partial lanes
    __m512i idx;
    if constexpr (G <= 4) {
      q = _mm512_add_ps(q, _mm512_permute_ps(q, 0x4E));  // lanes (0 + 2, 1 + 3)
      q = _mm512_add_ps(q, _mm512_permute_ps(q, 0xB1));  // and then (0 + 1): head c at 4c
      idx = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    } else {
      const __m512 q2 = quarter(halve(x[4], x[5]), halve(x[6], x[7]));  // heads 4-7
      // chunk c: [head c, head c + 4] two lanes each, then each pair added
      q = _mm512_add_ps(
          _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(q), _mm512_castps_pd(q2))),
          _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(q), _mm512_castps_pd(q2))));
      q = _mm512_add_ps(q, _mm512_permute_ps(q, 0xB1));  // head c at 4c, c + 4 at 4c + 2
      idx = _mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 0, 0, 0, 0, 0, 0, 0, 0);
    }
    alignas(64) float s[16];
    _mm512_store_ps(s, _mm512_permutexvar_ps(idx, q));
    for (int g = 0; g < G; ++g) out[g] = s[g];
  }
#else
  for (int g = 0; g < G; ++g) out[g] = hsum(d[g]);
#endif
}

#if defined(__AVX512F__)
// The same sums over keys instead of heads: one query's dot products with 16 key rows
// (`d` of key 2i and 2i + 1 halved together by `key_pair`, i < 8) -> one vector, key k in
// lane k. Each sum is added in exactly `hsums`'s order (any G >= 2), so a score has the same
// bits either way; the tree costs ~3 instructions a score where `hsums` takes ~5 (G = 8)
// to ~5.5 (G = 3), and the scores are stored as one vector instead of lane by lane.
__attribute__((always_inline)) inline __m512 key_pair(vf a, vf b) {
  return hsums_detail::halve(reinterpret_cast<__m512>(a), reinterpret_cast<__m512>(b));
}

__attribute__((always_inline)) inline __m512 key_sums16(const __m512* pairs) {
  using namespace hsums_detail;
  __m512 four[4];  // chunk c: key 4i + c's 4 partial lanes
  for (int i = 0; i < 4; ++i) four[i] = quarter(pairs[2 * i], pairs[2 * i + 1]);
  __m512 two[2];  // chunk c: keys 8i + c, 8i + c + 4, two lanes each (hsums' G > 4 step)
  for (int i = 0; i < 2; ++i) {
    const __m512d a = _mm512_castps_pd(four[2 * i]), b = _mm512_castps_pd(four[2 * i + 1]);
    two[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                           _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // lane (0 + 1) of each pair, as hsums' last add: chunk c holds keys c, c + 4, c + 8, c + 12
  const __m512 s = _mm512_add_ps(_mm512_shuffle_ps(two[0], two[1], 0x88),
                                 _mm512_shuffle_ps(two[0], two[1], 0xDD));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, s);
}
#endif

}  // namespace kvchat
