// The tiled matmul with x quantized to int8 per weight group, llama.cpp's way (its Q8_0
// activations): opt-in (`set_activation_bits(8)`, `--activations int8`), as int16 x
// (qmm_tiled.cpp) keeps ~f16 precision and int8 costs perplexity where activations have
// outliers. vpdpbusd multiplies 4 byte pairs per int32 lane where vpdpwssd multiplies 2
// word pairs, so the prefill kernel, compute-bound on VNNI, runs half the instructions.
//
// Same formula as the int16 kernels, y = sum over g of s * dx * isum + b * xsum, with
// isum the exact dot of the weight codes and int8 x, and xsum the quantized x's sum. Decode's few rows (`rows8`): the
// weights' unsigned codes are vpdpbusd's unsigned operand as they lie, x's 4 bytes its
// broadcast signed one. Prefill's many (`lanes8`): x rows fill the lanes, so x is the
// unsigned operand (x + 128) and a weight dword the broadcast signed one (8-bit codes -
// 128); the offsets come off exactly with per-group sums. Integer sums, then the same
// float operations per output in either kernel: a row's result does not depend on M.
// A symmetric format (Q4_0, Q8_0: bias = factor x scale) takes llama.cpp's integer form,
// y = sum over g of s * dx * (isum + factor * sum of x's int8): one float step a group less.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <algorithm>
#include <cmath>

#include "pool.h"
#include "qmm_tiled_int8.h"

namespace kvchat::tiled {

namespace {

constexpr int kRowBlock = 32;  // x rows per rows8 pass

void quantize_rows8(const float* x, int K, int group, int64_t m0, int64_t m1, QuantX8& qx) {
  const int G = K / group;
  for (int64_t m = m0; m < m1; ++m)
    for (int g = 0; g < G; ++g) {
      const float* src = x + m * K + int64_t(g) * group;
      float mx, sum;
      group_stats(src, group, mx, sum);
      const __m512 inv = _mm512_set1_ps(mx > 0.0f ? 127.0f / mx : 0.0f);
      int8_t* dst = qx.q.data() + m * K + int64_t(g) * group;
      __m512i qs = _mm512_setzero_si512();
      for (int k = 0; k < group; k += 16) {
        // round to nearest even, then saturate into int8
        const __m512i r = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(src + k), inv));
        const __m128i b = _mm512_cvtsepi32_epi8(r);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + k), b);
        qs = _mm512_add_epi32(qs, _mm512_cvtepi8_epi32(b));
      }
      const float scale = std::isnan(sum) ? sum : mx / 127.0f;  // NaN in, NaN out
      const int32_t qsum = _mm512_reduce_add_epi32(qs);
      qx.scale[m * G + g] = scale;
      qx.qsum[m * G + g] = qsum;
      // The biases meet the quantized x's sum, not x's own: y is then exactly the dequantized
      // weights times the quantized x (llama.cpp's Q8_1). With x's own sum an affine group's
      // error is s * sum q (x - x'), q in 0..15, not centred: the default Q4_1 model on
      // llama-perplexity's text and method read 18.594 that way, 18.380 this way (int16 x
      // 18.297, llama.cpp 18.391).
      qx.sum[m * G + g] = scale * float(qsum);
    }
}

// Rows m0..m1 (at most kRowBlock) of y for tile t: weight rows in the lanes.
template <int BITS, bool IB>
void rows8(const QuantWeights& q, const QuantX8& qx, int t, int64_t m0, int64_t m1,
           int64_t pf, float* y) {
  const int factor = int_bias(q);
  const int G = q.G, K = q.K, quads = q.group / 4, rows = int(m1 - m0);
  __m512 acc[kRowBlock];
  __m512i isum[kRowBlock];
  for (int r = 0; r < rows; ++r) acc[r] = _mm512_setzero_ps();
  const int64_t gbytes = int64_t(q.group) * 2 * BITS;
  for (int g = 0; g < G; ++g) {
    const uint8_t* wg = tile_group(q, t, g);
    if (pf)
      for (int64_t b = 0; b < gbytes; b += 64)  // never faults, even past the end
        _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(wg) + pf + b),
                     _MM_HINT_T0);
    for (int r = 0; r < rows; ++r)
      isum[r] = _mm512_set1_epi32(IB ? factor * qx.qsum[(m0 + r) * G + g] : 0);
    for (int q0 = 0; q0 < quads; q0 += 8) {
      __m512i w[8];
      for (int j = 0; j < 8; ++j) w[j] = quad_bytes<BITS>(wg, q0 + j);
      for (int r = 0; r < rows; ++r) {
        int32_t quad[8];  // 8 x 4 bytes of x
        std::memcpy(quad, qx.q.data() + (m0 + r) * K + int64_t(g) * q.group + q0 * 4, 32);
        __m512i a0 = _mm512_setzero_si512(), a1 = a0;  // two chains against the latency
        for (int j = 0; j < 8; j += 2) {
          a0 = _mm512_dpbusd_epi32(a0, w[j], _mm512_set1_epi32(quad[j]));
          a1 = _mm512_dpbusd_epi32(a1, w[j + 1], _mm512_set1_epi32(quad[j + 1]));
        }
        isum[r] = _mm512_add_epi32(isum[r], _mm512_add_epi32(a0, a1));
      }
    }
    const __m512 S = load_scales(q, t, g), B = load_biases(q, t, g, S);
    for (int r = 0; r < rows; ++r) {
      const int64_t mg = (m0 + r) * G + g;
      acc[r] = finish<IB>(acc[r], isum[r], _mm512_mul_ps(S, _mm512_set1_ps(qx.scale[mg])), B,
                          _mm512_set1_ps(qx.sum[mg]));
    }
  }
  for (int r = 0; r < rows; ++r)
    _mm512_storeu_ps(y + (m0 + r) * q.N + int64_t(t) * kTile, acc[r]);
}

// KVCHAT_BY_BITS takes one template argument: the bias forms spelled out.
template <int BITS>
void rows8_ib(const QuantWeights& q, const QuantX8& qx, int t, int64_t m0, int64_t m1,
              int64_t pf, float* y) {
  rows8<BITS, true>(q, qx, t, m0, m1, pf, y);
}
template <int BITS>
void rows8_f(const QuantWeights& q, const QuantX8& qx, int t, int64_t m0, int64_t m1,
             int64_t pf, float* y) {
  rows8<BITS, false>(q, qx, t, m0, m1, pf, y);
}

}  // namespace

void qmm_int8(const QuantWeights& q, const float* x, int64_t M, float* y, const Plan& plan) {
  auto& pool = ThreadPool::instance();
  const bool ib = int_bias(q) != 0;
  thread_local QuantX8 kept;  // reused: see qmm_tiled
  QuantX8& qx = kept;
  qx.q.resize(M * q.K);
  qx.scale.resize(M * q.G);
  qx.sum.resize(M * q.G);
  qx.qsum.resize(M * q.G);
  const int64_t x_per = (M + plan.x_tasks - 1) / plan.x_tasks;
  pool.run(int(plan.x_tasks), [&](int i) {
    quantize_rows8(x, q.K, q.group, i * x_per, std::min(M, (i + 1) * x_per), qx);
  });
  const int tiles = q.N / kTile;
  if (plan.lanes) return qmm_int8_lanes(q, qx, M, y, plan.tasks, ib);
  const int m_blocks = int((M + kRowBlock - 1) / kRowBlock);
  pool.run(plan.tasks, [&](int task) {
    int t0, t1;
    task_tiles(tiles, plan.tasks, task, t0, t1);
    for (int t = t0; t < t1; ++t)
      for (int mb = 0; mb < m_blocks; ++mb)
        (ib ? KVCHAT_BY_BITS(q.bits, rows8_ib) : KVCHAT_BY_BITS(q.bits, rows8_f))(
            q, qx, t, int64_t(mb) * kRowBlock,
            std::min<int64_t>(M, int64_t(mb + 1) * kRowBlock), plan.prefetch, y);
  });
}

}  // namespace kvchat::tiled

#endif
