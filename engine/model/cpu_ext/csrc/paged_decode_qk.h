// Scores of quantized key rows, 16 rows per pass, by integer dot products (AVX-512 VNNI),
// for the register-resident decode kernel (paged_decode_task.h).
//
// A key row stored as k = s * k_int + b per group (k_int 4 or 8 bits, unsigned) scores
//   q . k = sum over groups of  s * (q_g . k_int_g) + b * sum(q_g).
// Each task quantizes its scaled queries once to int16 per (head, group) (step = max|q_g| /
// 32767: a relative error of ~1e-5, far below the keys' own 8-bit rounding), sums them in
// float, and then scores a run of 16 rows at once: the rows' bytes are transposed as a
// 16 x 16 matrix of dwords (4 elements of a row in each), so that one vpdpwssd multiplies 2
// elements of all 16 rows by a broadcast query pair and no row needs a horizontal sum. One
// transpose serves every query head of the GQA group. 4-bit rows are expanded to bytes
// first, in the (evens, odds) order of each 32-chunk the queries are permuted to.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "paged_decode_kernel.h"

namespace kvchat::decode_task {

#if defined(__AVX512BW__) && defined(__AVX512VNNI__)

constexpr bool kIntKeys = true;
constexpr int kMaxKeyGroups = 4;  // D 128 at group 32

// The queries of one task as int16 pairs: lo[g][j] = (q[4j], q[4j+2]), hi[g][j] =
// (q[4j+1], q[4j+3]) of head g, each group's step and float sum.
template <int D, int G>
struct IntQueries {
  uint32_t lo[G][D / 4], hi[G][D / 4];
  float step[G][kMaxKeyGroups], sum[G][kMaxKeyGroups];

  // q: G rows of D floats (scaled, in the K rows' element order); group: K's group size.
  void set(const float* q, int group) {
    for (int g = 0; g < G; ++g) {
      int16_t qi[D];
      for (int gi = 0; gi < D / group; ++gi) {
        const float* x = q + size_t(g) * D + gi * group;
        float m = 0.0f, s = 0.0f;
        for (int d = 0; d < group; ++d) {
          m = std::max(m, std::abs(x[d]));
          s += x[d];
        }
        const float unit = m > 0.0f ? m / 32767.0f : 0.0f;
        const float inv = m > 0.0f ? 32767.0f / m : 0.0f;
        for (int d = 0; d < group; ++d)
          qi[gi * group + d] = int16_t(std::max(-32767.0f, std::min(32767.0f, std::rint(x[d] * inv))));
        step[g][gi] = unit;
        sum[g][gi] = s;
      }
      for (int j = 0; j < D / 4; ++j) {
        lo[g][j] = uint32_t(uint16_t(qi[4 * j])) | uint32_t(uint16_t(qi[4 * j + 2])) << 16;
        hi[g][j] = uint32_t(uint16_t(qi[4 * j + 1])) | uint32_t(uint16_t(qi[4 * j + 3])) << 16;
      }
    }
  }
};

// 64 elements of a key row as bytes (4-bit rows expanded in (evens, odds) order).
template <int Bits>
inline __m512i key_bytes(const uint8_t* row, int slab) {
  if constexpr (Bits == 8) {
    return _mm512_loadu_si512(row + slab * 64);
  } else {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + slab * 32));
    __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(x), _mm256_srli_epi16(x, 4), 1);
    z = _mm512_and_si512(z, _mm512_set1_epi8(0x0f));
    // lanes: lo(bytes 0-15), lo(16-31), hi(0-15), hi(16-31) -> per 32-chunk (lo, hi)
    return _mm512_shuffle_i64x2(z, z, _MM_SHUFFLE(3, 1, 2, 0));
  }
}

// Each group's scale and bias of the 16 rows from `row` on (lanes [a, b) valid, the rest 0).
template <int NG>
inline void group_params(const Side& k, int64_t row, int a, int b, vf* S, vf* B) {
  if (a == 0 && b == W) {
    if constexpr (NG == 1) {
      S[0] = load_any(k.scales, k.scale_elem, row);
      B[0] = load_any(k.biases, k.scale_elem, row);
      return;
    }
    float s[NG * W], t[NG * W];
    for (int c = 0; c < NG; ++c) {
      store(s + c * W, load_any(k.scales, k.scale_elem, row * NG + c * W));
      store(t + c * W, load_any(k.biases, k.scale_elem, row * NG + c * W));
    }
    for (int gi = 0; gi < NG; ++gi)
      for (int i = 0; i < W; ++i) {
        S[gi][i] = s[i * NG + gi];
        B[gi][i] = t[i * NG + gi];
      }
    return;
  }
  for (int gi = 0; gi < NG; ++gi) {
    S[gi] = vf{};
    B[gi] = vf{};
    for (int i = a; i < b; ++i) {
      S[gi][i] = scalar_any(k.scales, k.scale_elem, (row + i) * NG + gi);
      B[gi][i] = scalar_any(k.biases, k.scale_elem, (row + i) * NG + gi);
    }
  }
}

// Scores of rows row .. row + 15 (lanes [a, b) valid; the others come out 0) for G heads.
template <int D, int G, int NG, int Bits>
inline void score_rows(const Side& k, int64_t row, int a, int b, const IntQueries<D, G>& qq,
                       vf* out) {
  const uint8_t* base = reinterpret_cast<const uint8_t*>(k.data);
  // four partial sums per head and group (even and odd elements of even and odd dwords):
  // one chain of 2 * D / 4 dependent vpdpwssd would bound the loop by their latency
  __m512i acc[G][NG][4];
  for (int g = 0; g < G; ++g)
    for (int gi = 0; gi < NG; ++gi)
      for (int c = 0; c < 4; ++c) acc[g][gi][c] = _mm512_setzero_si512();
  const __m512i low_bytes = _mm512_set1_epi32(0x00ff00ff);
  for (int slab = 0; slab < D / 64; ++slab) {
    vf m[W];
    for (int i = 0; i < W; ++i) {
      const __m512i x = i >= a && i < b ? key_bytes<Bits>(base + (row + i) * k.row_bytes, slab)
                                        : _mm512_setzero_si512();
      std::memcpy(&m[i], &x, sizeof(x));
    }
    transpose16(m);  // m[j]: dword j of the slab (elements 4j..4j+3) of every row
#pragma GCC unroll 16
    for (int j = 0; j < W; ++j) {
      __m512i x;
      std::memcpy(&x, &m[j], sizeof(x));
      const __m512i even = _mm512_and_si512(x, low_bytes);  // elements 4j, 4j+2 as int16
      const __m512i odd = _mm512_srli_epi16(x, 8);  // 4j+1, 4j+3
      const int dw = slab * W + j, gi = dw * 4 * NG / D;
      const int c = (j & 1) * 2;
      for (int g = 0; g < G; ++g) {
        __m512i* a = acc[g][gi];
        a[c] = _mm512_dpwssd_epi32(a[c], even, _mm512_set1_epi32(int(qq.lo[g][dw])));
        a[c + 1] = _mm512_dpwssd_epi32(a[c + 1], odd, _mm512_set1_epi32(int(qq.hi[g][dw])));
      }
    }
  }
  vf S[NG], B[NG];
  group_params<NG>(k, row, a, b, S, B);
  for (int g = 0; g < G; ++g) {
    vf s{};
    for (int gi = 0; gi < NG; ++gi) {
      const __m512i* a = acc[g][gi];  // integer sums: exact in any order
      const __m512i sum = _mm512_add_epi32(_mm512_add_epi32(a[0], a[1]),
                                           _mm512_add_epi32(a[2], a[3]));
      const vf dot = reinterpret_cast<vf>(_mm512_cvtepi32_ps(sum));
      s += dot * (S[gi] * qq.step[g][gi]) + B[gi] * qq.sum[g][gi];
    }
    out[g] = s;
  }
}

template <int D, int G, int NG>
inline void score_rows_bits(const Side& k, int64_t row, int a, int b,
                            const IntQueries<D, G>& qq, vf* out) {
  if (k.bits == 8)
    score_rows<D, G, NG, 8>(k, row, a, b, qq, out);
  else
    score_rows<D, G, NG, 4>(k, row, a, b, qq, out);
}

// Scores of block rows [r0, r1) (the block's first row `row0`) into p (G x padded_bs):
// 16-row runs from r0 rounded down to 16, so p's lanes before r0 get garbage never read.
template <int D, int G>
inline void score_block(const Side& k, int64_t row0, int r0, int r1, const IntQueries<D, G>& qq,
                        float* p, int padded_bs) {
  const int ng = D / k.group;
  for (int c0 = r0 / W * W; c0 < r1; c0 += W) {
    vf s[G];
    const int a = std::max(r0 - c0, 0), b = std::min(r1 - c0, W);
    if (ng == 1)
      score_rows_bits<D, G, 1>(k, row0 + c0, a, b, qq, s);
    else if (ng == 2)
      score_rows_bits<D, G, 2>(k, row0 + c0, a, b, qq, s);
    else
      score_rows_bits<D, G, 4>(k, row0 + c0, a, b, qq, s);
    for (int g = 0; g < G; ++g) store(p + size_t(g) * padded_bs + c0, s[g]);
  }
}

// Quantized value rows [r0, r1) of a block (first row `row0`) into the accumulators:
//   acc += p_r * (s_r * v_int + b_r) = (p_r * s_r) * v_int,  bias[g][group] += p_r * b_r,
// the biases' sum added to acc once at the end (`add_value_biases`). p: G x padded_bs
// probabilities, valid in [r0, r1). 4-bit rows come out in `Side::row`'s order.
template <int NV, int G, int NG, int Bits>
inline void accumulate_values(const Side& v, int64_t row0, int r0, int r1, const float* p,
                              int padded_bs, vf (*acc)[NV], float (*bias)[kMaxKeyGroups]) {
  constexpr int D = NV * W;
  const uint8_t* base = reinterpret_cast<const uint8_t*>(v.data);
  for (int c0 = r0 / W * W; c0 < r1; c0 += W) {
    const int a = std::max(r0 - c0, 0), b = std::min(r1 - c0, W);
    const __mmask16 valid = __mmask16(((1u << b) - 1) & ~((1u << a) - 1));
    vf S[NG], B[NG];
    group_params<NG>(v, row0 + c0, a, b, S, B);
    alignas(64) float ps[G][NG][W];  // p_r * s_r of each head and group
    for (int g = 0; g < G; ++g) {
      const vf pr = reinterpret_cast<vf>(_mm512_maskz_loadu_ps(valid, p + size_t(g) * padded_bs + c0));
      for (int gi = 0; gi < NG; ++gi) {
        store(ps[g][gi], pr * S[gi]);
        bias[g][gi] += hsum(pr * B[gi]);
      }
    }
    for (int i = a; i < b; ++i) {
      const uint8_t* row = base + (row0 + c0 + i) * v.row_bytes;
      vf x[NV];
      for (int j = 0; j < NV; j += 2) {
        vb raw0, raw1;
        if constexpr (Bits == 4) {
          std::memcpy(&raw1, row + j * W / 2, 16);
          nibbles(raw1, raw0, raw1);
        } else {
          std::memcpy(&raw0, row + j * W, 16);
          std::memcpy(&raw1, row + j * W + 16, 16);
        }
        x[j] = bytes_to_float(raw0);
        x[j + 1] = bytes_to_float(raw1);
      }
      for (int g = 0; g < G; ++g)
        for (int j = 0; j < NV; ++j) acc[g][j] += splat(ps[g][j * NG / NV][i]) * x[j];
    }
  }
}

template <int NV, int G>
inline void value_block(const Side& v, int64_t row0, int r0, int r1, const float* p,
                        int padded_bs, vf (*acc)[NV], float (*bias)[kMaxKeyGroups]) {
  const int ng = NV * W / v.group;
  auto run = [&](auto ng_c) {
    constexpr int NG = decltype(ng_c)::value;
    if (v.bits == 8)
      accumulate_values<NV, G, NG, 8>(v, row0, r0, r1, p, padded_bs, acc, bias);
    else
      accumulate_values<NV, G, NG, 4>(v, row0, r0, r1, p, padded_bs, acc, bias);
  };
  if (ng == 1)
    run(std::integral_constant<int, 1>{});
  else if (ng == 2)
    run(std::integral_constant<int, 2>{});
  else
    run(std::integral_constant<int, 4>{});
}

// acc[g] += each group's sum of p_r * b_r over its dims.
template <int NV, int G>
inline void add_value_biases(const Side& v, vf (*acc)[NV], float (*bias)[kMaxKeyGroups]) {
  const int per_group = v.group / W;  // vectors per group
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < NV; ++j) acc[g][j] += splat(bias[g][j / per_group]);
}

#else

constexpr bool kIntKeys = false;
constexpr int kMaxKeyGroups = 4;

template <int D, int G>
struct IntQueries {
  void set(const float*, int) {}
};

template <int D, int G>
inline void score_block(const Side&, int64_t, int, int, const IntQueries<D, G>&, float*, int) {}

template <int NV, int G>
inline void value_block(const Side&, int64_t, int, int, const float*, int, vf (*)[NV],
                        float (*)[kMaxKeyGroups]) {}

template <int NV, int G>
inline void add_value_biases(const Side&, vf (*)[NV], float (*)[kMaxKeyGroups]) {}

#endif

}  // namespace kvchat::decode_task
