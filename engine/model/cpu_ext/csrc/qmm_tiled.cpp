// The quantized matmul for 4/8-bit weights in kvchat's tiled layout, with x
// quantized to int16 per weight group and multiplied with AVX-512 VNNI
// (vpdpwssd: 32 exact integer multiply-adds in one instruction). Opt-in int8 x,
// llama.cpp's way: qmm_tiled_int8.cpp (`set_activation_bits`).
//
// Why: the float GEMV spends ~10 vector instructions per 32 weights
// dequantizing and multiplying; here 16 rows x 32 weights take ~16 byte shuffles
// (shared by every x row) and 16 vpdpwssd and ~6 others per x row, and
// decode's matmuls stop being compute-bound on a 2-core machine. Why int16 and
// not llama.cpp's int8 (vpdpbusd, twice the rate): this model's activations
// have outliers ~100x their median, and int8 groups of 32 then cost ~2 % of
// perplexity (measured); int16 keeps ~f16 precision.
//
// Layout (ops.py's `tile`, the same bytes as MLX's): rows in tiles of 16. For
// tile t, group g and quad j (4 weights) of the group, 16 rows x 4 bytes: byte
// 4i + b is weight k = g * group + 4j + b of row 16t + i. 8 bits: 64 bytes per
// quad. 4 bits: quads 2p and 2p + 1 share 64 bytes, 2p in the low nibbles.
// Scales and biases are (t, g, i) ordered: 16 rows of a group in one load.
//
// y[m, n] = sum over groups g, in order, of s[n,g] * dx[m,g] * isum + b[n,g] * xsum[m,g],
// where isum is the exact int32 dot product of the group, dx x's int16 scale and
// xsum the float sum of x over the group. The order of float operations per
// (m, n) does not depend on M or on how work is split, so a row's result is the
// same alone or in a batch, in decode or prefill. Two kernels compute it, bit
// for bit alike: tile_rows here (weight rows in the vector lanes, for decode's
// few x rows) and qmm_tiled_lanes.cpp (x rows in the lanes, for prefill).
#include "qmm_tiled.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "pool.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define KVCHAT_TILED 1
#include "qmm_tiled_impl.h"
#endif

namespace kvchat {

namespace {
// KVCHAT_ACTIVATIONS=int8 sets the process's mode before anything runs (`--activations`
// sets it for the processes it starts, distributed ranks included).
int initial_activation_bits() {
  const char* env = std::getenv("KVCHAT_ACTIVATIONS");
  return env && std::strcmp(env, "int8") == 0 ? 8 : 16;
}

std::atomic<int> g_activation_bits{initial_activation_bits()};
}  // namespace

void set_activation_bits(int bits) {
  if (bits != 8 && bits != 16) throw std::invalid_argument("activation bits must be 8 or 16");
  g_activation_bits.store(bits);
}

int activation_bits() {
  return g_activation_bits.load(std::memory_order_relaxed);
}

bool tiled_supported() {
#ifdef KVCHAT_TILED
  return true;
#else
  return false;
#endif
}

#ifdef KVCHAT_TILED

namespace {

using namespace tiled;

constexpr int kRowBlock = 32;  // x rows per pass over a tile's groups
constexpr int kQuadsPerChunk = 8;  // unpacked weight registers live at once
// Jobs below this many multiply-adds stay on the calling thread: waking the
// other costs more than it saves.
constexpr int64_t kParallelMinMacs = 1 << 18;

// From this many x rows on, the lanes kernel (qmm_tiled_lanes.cpp) runs: measured on the
// default model's shapes, tile_rows is faster up to ~12 rows. KVCHAT_LANES_MIN overrides
// it, to compare the two.
int lanes_min_rows() {
  static const int n = [] {
    const char* env = std::getenv("KVCHAT_LANES_MIN");
    return env && std::atoi(env) > 0 ? std::atoi(env) : 14;
  }();
  return n;
}

// How far ahead of the group in use tile_rows prefetches weights (bytes; a task's tiles
// are contiguous). Decode's weights stream from L3/DRAM and the loads stalled: ~45 % of
// the kernel's samples sat on them. 4 kB ahead cut the default model's decode step by
// ~10 % (p10 13.7 -> 12.2 ms, interleaved). KVCHAT_PREFETCH overrides it (0: off).
int64_t prefetch_bytes() {
  static const int64_t n = [] {
    const char* env = std::getenv("KVCHAT_PREFETCH");
    return env ? int64_t(std::max(0, std::atoi(env))) : int64_t(4096);
  }();
  return n;
}

void quantize_rows(const float* x, int K, int group, int64_t m0, int64_t m1, QuantX& qx) {
  const int G = K / group;
  for (int64_t m = m0; m < m1; ++m) {
    for (int g = 0; g < G; ++g) {
      const float* src = x + m * K + int64_t(g) * group;
      float mx, sum;
      group_stats(src, group, mx, sum);
      const __m512 inv = _mm512_set1_ps(mx > 0.0f ? 32767.0f / mx : 0.0f);
      int16_t* dst = qx.q.data() + m * K + int64_t(g) * group;
      for (int k = 0; k < group; k += 16) {
        // round to nearest even, then saturate into int16
        const __m512i r = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(src + k), inv));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + k), _mm512_cvtsepi32_epi16(r));
      }
      qx.sum[m * G + g] = sum;
      qx.scale[m * G + g] = std::isnan(sum) ? sum : mx / 32767.0f;  // NaN in, NaN out
    }
  }
}

// A quad's 16 rows x 4 bytes (row i in dword i) as two vectors of int16 pairs with row i
// in lane i: its bytes (0, 1) and (2, 3). vpdpwssd with x's pairs (x0, x1) and (x2, x3)
// broadcast then sums each weight row in its own lane: no lanes to add across afterwards
// (a split into rows 0-7 and 8-15 cost 2 permutes and 3 adds a row and group), and one
// byte shuffle a vector widens it (a zero-extension took 1.5).
inline void widen_rows(__m512i w, __m512i& w01, __m512i& w23) {
  // within each 128-bit lane, dword i takes bytes 4i, 4i + 1 (or 4i + 2, 4i + 3) as words
  const __m512i lo = _mm512_broadcast_i32x4(
      _mm_setr_epi32(int(0x80018000u), int(0x80058004u), int(0x80098008u), int(0x800D800Cu)));
  const __m512i hi = _mm512_broadcast_i32x4(
      _mm_setr_epi32(int(0x80038002u), int(0x80078006u), int(0x800B800Au), int(0x800F800Eu)));
  w01 = _mm512_shuffle_epi8(w, lo);
  w23 = _mm512_shuffle_epi8(w, hi);
}

// acc += w . (the int16 pair at x, broadcast): the broadcast as vpdpwssd's memory operand,
// a load (the compiler broadcast pairs it had loaded into general registers, a
// shuffle-port instruction each, and the kernel got slower than before)
inline void dpwssd_pair(__m512i& acc, __m512i w, const int32_t* x) {
  asm("vpdpwssd %[x]%{1to16%}, %[w], %[acc]" : [acc] "+v"(acc) : [w] "v"(w), [x] "m"(*x));
}

// Rows m0..m1 (at most kRowBlock) of y for tile t.
template <int BITS>
void tile_rows(const QuantWeights& q, const QuantX& qx, int t, int64_t m0, int64_t m1,
               float* y) {
  const int G = q.G, K = q.K, group = q.group;
  const int quads = group / 4;  // per tile-group: 64 bytes each (8 bits), 2 per 64 (4 bits)
  __m512 acc[kRowBlock];
  __m512i isum[kRowBlock];
  const int rows = int(m1 - m0);
  for (int r = 0; r < rows; ++r) acc[r] = _mm512_setzero_ps();
  const int64_t gbytes = int64_t(q.group) * 2 * BITS;
  const int64_t pf = prefetch_bytes();
  __m512 k_step = _mm512_setzero_ps(), k_bstep = k_step;
  for (int g = 0; g < G; ++g) {
    const uint8_t* wg = tile_group(q, t, g);
    if (pf)
      for (int64_t b = 0; b < gbytes; b += 64)  // never faults, even past the end
        _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(wg) + pf + b),
                     _MM_HINT_T0);
    for (int q0 = 0; q0 < quads; q0 += kQuadsPerChunk) {
      // widened once per chunk, used by every row of x (prefill has hundreds)
      __m512i w01[kQuadsPerChunk], w23[kQuadsPerChunk];
      for (int j = 0; j < kQuadsPerChunk; ++j)
        widen_rows(quad_bytes<BITS>(wg, q0 + j), w01[j], w23[j]);
      for (int r = 0; r < rows; ++r) {
        // quad j's x pairs (x0, x1), (x2, x3) at x[2j], x[2j + 1]
        const auto* x = reinterpret_cast<const int32_t*>(qx.q.data() + (m0 + r) * K +
                                                         int64_t(g) * group + q0 * 4);
        __m512i sum;
        if (rows == 1) {  // four chains: vpdpwssd's latency would serialize the sixteen
          __m512i a0 = _mm512_setzero_si512(), b0 = a0, a1 = a0, b1 = a0;
          for (int j = 0; j < kQuadsPerChunk; j += 2) {
            dpwssd_pair(a0, w01[j], x + 2 * j);
            dpwssd_pair(b0, w23[j], x + 2 * j + 1);
            dpwssd_pair(a1, w01[j + 1], x + 2 * j + 2);
            dpwssd_pair(b1, w23[j + 1], x + 2 * j + 3);
          }
          sum = _mm512_add_epi32(_mm512_add_epi32(a0, b0), _mm512_add_epi32(a1, b1));
        } else {  // two: the next row's chains overlap these
          __m512i a = _mm512_setzero_si512(), b = a;
          for (int j = 0; j < kQuadsPerChunk; ++j) {
            dpwssd_pair(a, w01[j], x + 2 * j);
            dpwssd_pair(b, w23[j], x + 2 * j + 1);
          }
          sum = _mm512_add_epi32(a, b);
        }
        // (exact integer sums in any order) set by the group's first chunk: zeroing isum
        // first was a memset call a group
        isum[r] = q0 == 0 ? sum : _mm512_add_epi32(isum[r], sum);
      }
    }
    if (q.kquant && g % 8 == 0) {  // a K-quant block's steps serve its 8 groups
      k_step = kquant_step(q.scales, G, t, g);
      k_bstep = kquant_step(q.biases, G, t, g);
    }
    const __m512 S = q.kquant ? kquant_value(q.scales, G, t, g, k_step) : load_scales(q, t, g);
    const __m512 B =
        q.kquant ? kquant_value(q.biases, G, t, g, k_bstep) : load_biases(q, t, g, S);
    for (int r = 0; r < rows; ++r) {
      const int64_t mg = (m0 + r) * G + g;
      const __m512 f = _mm512_cvtepi32_ps(isum[r]);
      acc[r] = _mm512_fmadd_ps(f, _mm512_mul_ps(S, _mm512_set1_ps(qx.scale[mg])), acc[r]);
      acc[r] = _mm512_fmadd_ps(B, _mm512_set1_ps(qx.sum[mg]), acc[r]);
    }
  }
  for (int r = 0; r < rows; ++r)
    _mm512_storeu_ps(y + (m0 + r) * q.N + int64_t(t) * kTile, acc[r]);
}

}  // namespace

void qmm_tiled(const QuantWeights& q, const float* x, int64_t M, float* y) {
  // group must be a multiple of 32 (whole chunks of 8 quads) and N of 16
  auto& pool = ThreadPool::instance();
  const int64_t macs = M * q.N * int64_t(q.K);
  const bool parallel = macs >= kParallelMinMacs && pool.size() > 1;
  const int tiles = q.N / kTile;
  // Tasks are runs of tiles; each walks every block of x rows over its tiles.
  const tiled::Plan plan{parallel ? std::min(tiles, 4 * pool.size()) : 1,
                  parallel ? std::min<int64_t>(M, 8) : 1, M >= lanes_min_rows(),
                  prefetch_bytes()};
  if (activation_bits() == 8) return tiled::qmm_int8(q, x, M, y, plan);
  // Kept per calling thread: a fresh buffer of a prefill's size is page faults and zeroing
  // each call. A named reference, as lambdas that name a thread_local see the running
  // thread's own (the pool's worker's would be empty).
  thread_local QuantX kept;
  QuantX& qx = kept;
  qx.q.resize(M * q.K);
  qx.scale.resize(M * q.G);
  qx.sum.resize(M * q.G);
  const int64_t x_per = (M + plan.x_tasks - 1) / plan.x_tasks;
  pool.run(int(plan.x_tasks), [&](int i) {
    quantize_rows(x, q.K, q.group, i * x_per, std::min(M, (i + 1) * x_per), qx);
  });
  const int tasks = plan.tasks;
  if (plan.lanes) return tiled::qmm_lanes(q, qx, M, y, tasks);
  const int m_blocks = int((M + kRowBlock - 1) / kRowBlock);
  pool.run(tasks, [&](int task) {
    int t0, t1;
    tiled::task_tiles(tiles, tasks, task, t0, t1);
    for (int t = t0; t < t1; ++t)
      for (int mb = 0; mb < m_blocks; ++mb)
        KVCHAT_BY_BITS(q.bits, tile_rows)(
            q, qx, t, int64_t(mb) * kRowBlock,
            std::min<int64_t>(M, int64_t(mb + 1) * kRowBlock), y);
  });
}

#else

void qmm_tiled(const QuantWeights&, const float*, int64_t, float*) {
  throw std::runtime_error("qmm: the tiled path needs AVX-512 VNNI");
}

#endif

}  // namespace kvchat
