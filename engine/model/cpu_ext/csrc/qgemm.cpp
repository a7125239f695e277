// The prefill GEMM of the quantized matmul: y = x @ dequantize(w).T for many
// rows of x.
//
// Every weight is used by all M rows, so each is dequantized once per call:
// panels of kNC weight rows are unpacked into a float buffer that stays in L2
// (k-major, kNR columns side by side), x is packed once into k-major panels of
// kMR rows, and a register-blocked micro-kernel (kMR rows x kNR columns of
// accumulators) multiplies the two as straight streams. Tasks are (weight
// panel, block of x rows); float32 throughout.
//
// Why not dequantize + cblas_sgemm: Debian's OpenBLAS 0.3.21 does not know
// newer Xeons (family 6 model 207 here) and runs its SSE3 "Prescott" kernels,
// 5-6x slower than this at M = 512; and this skips the float32 copy of w.
#include <algorithm>
#include <vector>

#include "pool.h"
#include "quant.h"

namespace kvchat {

namespace {

constexpr int kNR = 2 * W;  // columns per micro-kernel: 2 vectors
// Rows per micro-kernel: 12 x 2 accumulators + 2 weight vectors fit AVX-512's 32
// registers; AVX2 and NEON hold a vector in 2 or 4 registers, so fewer rows.
#if defined(__AVX512F__)
constexpr int kMR = 12;
#else
constexpr int kMR = 2;
#endif
constexpr int kNC = 4 * kNR;  // weight rows per panel: K x 128 floats (<= 0.8 MB at K 1536)
constexpr int kMC = 22 * kMR;  // x rows per task (a task re-reads its panel from L2)
constexpr int kKC = 640;  // most of K per pass: an x panel's slice stays in L1

// Rows n0 .. n0 + kNR of w (zeros past N) in natural k order, k-major:
// dst[k * kNR + j] is w[n0 + j, k]. 16 rows x 32 weights at a time are
// dequantized into registers and transposed there (one scattered store per
// weight would miss L1 on every column of a K x kNR panel).
template <int BITS>
void pack_weights(const QuantWeights& q, int n0, float* dst) {
  for (int j0 = 0; j0 < kNR; j0 += W) {
    for (int k = 0; k < q.K; k += 32) {
      const int g = k / q.group;
      vf lo[W], hi[W];  // row j0 + i: weights k .. k + 15 and k + 16 .. k + 31
      for (int i = 0; i < W; ++i) {
        const int n = n0 + j0 + i;
        if (n >= q.N) {
          lo[i] = hi[i] = vf{};
          continue;
        }
        const uint8_t* row = q.w + n * q.row_bytes();
        const vf S = splat(scalar_any(q.scales, q.elem, int64_t(n) * q.G + g));
        const vf B = splat(scalar_any(q.biases, q.elem, int64_t(n) * q.G + g));
        if constexpr (BITS == 4) {
          vb lo4, hi4, first, second;
          nibbles(load_bytes(row + k / 2), lo4, hi4);
          interleave(lo4, hi4, first, second);  // back to the natural order
          lo[i] = bytes_to_float(first) * S + B;
          hi[i] = bytes_to_float(second) * S + B;
        } else {
          lo[i] = bytes_to_float(load_bytes(row + k)) * S + B;
          hi[i] = bytes_to_float(load_bytes(row + k + W)) * S + B;
        }
      }
      transpose16(lo);
      transpose16(hi);
      for (int i = 0; i < W; ++i) {
        store(dst + (k + i) * kNR + j0, lo[i]);
        store(dst + (k + W + i) * kNR + j0, hi[i]);
      }
    }
  }
}

// Rows m0 .. m0 + kMR of x (zeros past M), k-major: dst[k * kMR + r] is x[m0 + r, k].
void pack_x(const float* x, int64_t M, int K, int64_t m0, float* dst) {
  for (int r = 0; r < kMR; ++r) {
    const float* src = x + (m0 + r) * K;
    if (m0 + r >= M) {
      for (int k = 0; k < K; ++k) dst[k * kMR + r] = 0.0f;
    } else {
      for (int k = 0; k < K; ++k) dst[k * kMR + r] = src[k];
    }
  }
}

// y[r, j] (rows < `rows`, columns < `cols`) = sum over K of xp[k, r] * wp[k, j],
// added to what y holds unless `first`.
inline void micro_kernel(const float* xp, const float* wp, int K, float* y, int64_t ldy,
                         int rows, int cols, bool first) {
  vf acc[kMR][2];
  for (int r = 0; r < kMR; ++r) acc[r][0] = acc[r][1] = vf{};
  for (int k = 0; k < K; ++k) {
    const vf w0 = load(wp + k * kNR), w1 = load(wp + k * kNR + W);
    for (int r = 0; r < kMR; ++r) {
      const vf xs = splat(xp[k * kMR + r]);
      acc[r][0] += xs * w0;
      acc[r][1] += xs * w1;
    }
  }
  for (int r = 0; r < rows; ++r) {
    float* dst = y + r * ldy;
    if (cols == kNR) {
      store(dst, first ? acc[r][0] : acc[r][0] + load(dst));
      store(dst + W, first ? acc[r][1] : acc[r][1] + load(dst + W));
    } else {
      for (int j = 0; j < cols; ++j)
        dst[j] = (first ? 0.0f : dst[j]) + (j < W ? acc[r][0][j] : acc[r][1][j - W]);
    }
  }
}

}  // namespace

void gemm(const QuantWeights& q, const float* x, int64_t M, float* y) {
  const int K = q.K;
  const int64_t x_panels = (M + kMR - 1) / kMR;
  std::vector<float> xp(x_panels * kMR * K);
  auto& pool = ThreadPool::instance();
  const int pack_tasks = int(std::min<int64_t>(x_panels, 8));
  const int64_t per_task = (x_panels + pack_tasks - 1) / pack_tasks;
  pool.run(pack_tasks, [&](int t) {
    for (int64_t p = t * per_task; p < std::min(x_panels, (t + 1) * per_task); ++p)
      pack_x(x, M, K, p * kMR, xp.data() + p * kMR * K);
  });
  const int k_blocks = (K + kKC - 1) / kKC;
  const int kc = (K / 32 + k_blocks - 1) / k_blocks * 32;  // even blocks, whole 32-chunks
  const int w_panels = (q.N + kNC - 1) / kNC;
  const int m_blocks = int((M + kMC - 1) / kMC);
  pool.run(w_panels * m_blocks, [&](int task) {
    const int n0 = task / m_blocks * kNC, n1 = std::min(q.N, n0 + kNC);
    const int64_t m0 = int64_t(task % m_blocks) * kMC, m1 = std::min(M, m0 + kMC);
    thread_local std::vector<float> wp;
    wp.resize(size_t(kNC) * K);
    for (int n = n0; n < n1; n += kNR) {
      float* dst = wp.data() + size_t(n - n0) * K;
      if (q.bits == 4)
        pack_weights<4>(q, n, dst);
      else
        pack_weights<8>(q, n, dst);
    }
    // Each x panel's slice of K (at most kKC x kMR, in L1) meets every column
    // block of the weight panel.
    for (int k0 = 0; k0 < K; k0 += kc) {
      const int k1 = std::min(K, k0 + kc);
      for (int64_t m = m0; m < m1; m += kMR) {
        const float* xm = xp.data() + m * K + int64_t(k0) * kMR;
        for (int n = n0; n < n1; n += kNR)
          micro_kernel(xm, wp.data() + size_t(n - n0) * K + size_t(k0) * kNR, k1 - k0,
                       y + m * q.N + n, q.N, int(std::min<int64_t>(kMR, M - m)),
                       std::min(kNR, n1 - n), k0 == 0);
      }
    }
  });
}

}  // namespace kvchat
