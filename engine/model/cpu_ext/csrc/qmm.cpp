// Quantized matmul y = x @ dequantize(w).T for MLX affine 4/8-bit weights.
//
// Decode (few rows of x): a GEMV that dequantizes each 32-weight chunk into
// registers once and multiplies it into up to 4 rows of x; rows of w are split
// over the pool. Prefill (many rows): the GEMM of qgemm.cpp. Accumulation is
// float32 throughout.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "kernels.h"
#include "ops.h"
#include "pool.h"
#include "qmm_tiled.h"
#include "quant.h"
#include "tensor.h"

namespace kvchat {

namespace {

// x rows at or below this use the GEMV; above, the GEMM
// (KVCHAT_QMM_GEMV_ROWS overrides it, for tuning on another machine).
int gemv_max_rows() {
  static const int rows = [] {
    const char* env = std::getenv("KVCHAT_QMM_GEMV_ROWS");
    return env ? std::atoi(env) : 16;
  }();
  return rows;
}
// Waking a sleeping second thread costs 50-300 us on the 2-core build VMs, but in
// a decode step the op before has left it spinning: jobs from this many weights
// (~0.1 ms on one core) use the pool (gate/up at M=1: 373 -> 178 us).
constexpr int64_t kParallelMinWeights = 256 << 10;

// The 32 weights at k of a row, dequantized: for 4 bits, w0 holds the even
// positions k, k+2, ... and w1 the odd ones (the nibble order in a byte), so
// x is permuted to match (permute_x4); for 8 bits, natural order.
template <int BITS>
inline void dequant32(const uint8_t* row, int k, vf S, vf B, vf& w0, vf& w1) {
  if constexpr (BITS == 4) {
    vb lo, hi;
    nibbles(load_bytes(row + k / 2), lo, hi);
    w0 = bytes_to_float(lo) * S + B;
    w1 = bytes_to_float(hi) * S + B;
  } else {
    w0 = bytes_to_float(load_bytes(row + k)) * S + B;
    w1 = bytes_to_float(load_bytes(row + k + 16)) * S + B;
  }
}

// x rows with each 32-chunk reordered as (evens, odds): the 4-bit GEMV order.
void permute_x4(const float* x, float* xp, int64_t M, int K) {
  for (int64_t m = 0; m < M; ++m) {
    const float* src = x + m * K;
    float* dst = xp + m * K;
    for (int k = 0; k < K; k += 32) {
      for (int i = 0; i < 16; ++i) {
        dst[k + i] = src[k + 2 * i];
        dst[k + 16 + i] = src[k + 2 * i + 1];
      }
    }
  }
}

// y[m, n] for MB rows of x and R rows n..n+R of w: each chunk of w is
// dequantized once and used for every row of x; R > 1 gives the one-row case
// independent FMA chains and shares its loads of x.
template <int BITS, int MB, int R>
inline void gemv_tile(const QuantWeights& q, const float* x, int n, const float* params,
                      float* y, int64_t ldy) {
  const uint8_t* rows[R];
  for (int r = 0; r < R; ++r) rows[r] = q.w + (n + r) * q.row_bytes();
  vf acc0[R][MB], acc1[R][MB];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m) acc0[r][m] = acc1[r][m] = vf{};
  const int64_t ahead = int64_t(R) * q.row_bytes();  // the next tile's rows
  for (int g = 0; g < q.G; ++g) {
    vf S[R], B[R];
    for (int r = 0; r < R; ++r) {
      S[r] = splat(params[(2 * r) * q.G + g]);
      B[r] = splat(params[(2 * r + 1) * q.G + g]);
      // Weights stream from DRAM once per token: ask for the next tile's bytes early.
      __builtin_prefetch(rows[r] + ahead + int64_t(g) * q.group * BITS / 8);
    }
    for (int k = g * q.group; k < (g + 1) * q.group; k += 32) {
      vf x0[MB], x1[MB];
      for (int m = 0; m < MB; ++m) {
        x0[m] = load(x + int64_t(m) * q.K + k);
        x1[m] = load(x + int64_t(m) * q.K + k + 16);
      }
      for (int r = 0; r < R; ++r) {
        vf w0, w1;
        dequant32<BITS>(rows[r], k, S[r], B[r], w0, w1);
        for (int m = 0; m < MB; ++m) {
          acc0[r][m] += w0 * x0[m];
          acc1[r][m] += w1 * x1[m];
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m) y[m * ldy + n + r] = hsum(acc0[r][m] + acc1[r][m]);
}

template <int BITS, int MB>
void gemv_rows(const QuantWeights& q, const float* x, int n0, int n1, float* y, int64_t ldy) {
  constexpr int R = MB >= 4 ? 1 : 4 / MB;
  thread_local std::vector<float> params;
  params.resize(2 * R * q.G);
  int n = n0;
  for (; n + R <= n1; n += R) {
    for (int r = 0; r < R; ++r)
      q.row_params(n + r, params.data() + 2 * r * q.G, params.data() + (2 * r + 1) * q.G);
    gemv_tile<BITS, MB, R>(q, x, n, params.data(), y, ldy);
  }
  for (; n < n1; ++n) {
    q.row_params(n, params.data(), params.data() + q.G);
    gemv_tile<BITS, MB, 1>(q, x, n, params.data(), y, ldy);
  }
}

template <int BITS>
void gemv_block(const QuantWeights& q, const float* x, int64_t M, int n0, int n1, float* y) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) gemv_rows<BITS, 4>(q, x + m * q.K, n0, n1, y + m * q.N, q.N);
  if (M - m >= 2) {
    gemv_rows<BITS, 2>(q, x + m * q.K, n0, n1, y + m * q.N, q.N);
    m += 2;
  }
  if (M - m == 1) gemv_rows<BITS, 1>(q, x + m * q.K, n0, n1, y + m * q.N, q.N);
}

void gemv(const QuantWeights& q, const float* x, int64_t M, float* y) {
  std::vector<float> permuted;
  if (q.bits == 4) {
    permuted.resize(M * q.K);
    permute_x4(x, permuted.data(), M, q.K);
    x = permuted.data();
  }
  auto& pool = ThreadPool::instance();
  const bool parallel = int64_t(q.N) * q.K * M >= kParallelMinWeights && pool.size() > 1;
  const int tasks = parallel ? std::min(q.N / 8 + 1, 4 * pool.size()) : 1;
  const int per_task = (q.N + tasks - 1) / tasks;
  pool.run(tasks, [&](int t) {
    const int n0 = t * per_task, n1 = std::min(q.N, n0 + per_task);
    if (n0 >= n1) return;
    if (q.bits == 4)
      gemv_block<4>(q, x, M, n0, n1, y);
    else
      gemv_block<8>(q, x, M, n0, n1, y);
  });
}

}  // namespace

void qmm_into(const mx::array& x, const mx::array& w, const mx::array& scales,
         const mx::array& biases, mx::array& out, int group, int bits, bool tiled) {
  std::vector<float> x_buf;
  std::vector<char> w_buf, s_buf, b_buf;
  const float* xf = rows_as_float(x, x_buf);
  QuantWeights q;
  q.w = static_cast<const uint8_t*>(row_major(w, w_buf));
  q.scales = row_major(scales, s_buf);
  q.kquant = kquant_params(scales);
  q.elem = elem_of(param_dtype(scales));
  if (q.kquant && !tiled) throw std::invalid_argument("qmm: K-quant codes need tiled weights");
  if (scaled_biases(biases, scales)) {
    q.biases = nullptr;
    q.bias_factor = scalar_any(row_major(biases, b_buf), q.elem, 0);
    if (!tiled) throw std::invalid_argument("qmm: a (1, 1) bias factor needs tiled weights");
  } else {
    q.biases = row_major(biases, b_buf);
  }
  q.N = int(w.shape(0));
  q.K = int(x.shape(-1));
  q.G = q.K / group;
  q.group = group;
  q.bits = bits;
  const int64_t M = int64_t(x.size()) / q.K;
  std::vector<float> y_buf;
  float* y = out.dtype() == mx::float32 ? out.data<float>()
                                        : (y_buf.resize(M * q.N), y_buf.data());
  if (tiled)
    qmm_tiled(q, xf, M, y);
  else if (M <= gemv_max_rows())
    gemv(q, xf, M, y);
  else
    gemm(q, xf, M, y);
  if (out.dtype() != mx::float32) store_any(out.data<char>(), elem_of(out.dtype()), y, M * q.N);
}

void QuantizedMatmul::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (auto& a : inputs) encoder.set_input_array(a);
  encoder.set_output_array(out);
  encoder.dispatch([x = inputs[0], w = inputs[1], scales = inputs[2], biases = inputs[3], out,
                    group = group_size_, bits = bits_, tiled = tiled_]() mutable {
    guarded(out, [&] { qmm_into(x, w, scales, biases, out, group, bits, tiled); });
  });
}

void QuantizedMatmul::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("KvchatQuantizedMatmul runs on the CPU only");
}

bool QuantizedMatmul::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const QuantizedMatmul&>(other);
  return group_size_ == o.group_size_ && bits_ == o.bits_ && tiled_ == o.tiled_;
}

void check_qmm(int K, mx::Dtype x_dtype, const mx::array& w, const mx::array& scales,
               const mx::array& biases, int group_size, int bits, bool tiled) {
  if (bits != 4 && bits != 8 && !(tiled && (bits == 5 || bits == 6)))
    throw std::invalid_argument("qmm: bits must be 4 or 8 (5 or 6: tiled weights only)");
  if (group_size != 32 && group_size != 64 && group_size != 128)
    throw std::invalid_argument("qmm: group_size must be 32, 64 or 128");
  if (w.ndim() != 2 || scales.ndim() != 2 || biases.ndim() != 2)
    throw std::invalid_argument("qmm: x needs >= 1 dims; w, scales, biases 2");
  if (w.dtype() != mx::uint32) throw std::invalid_argument("qmm: w must be uint32 (packed)");
  const bool kquant = kquant_params(scales);
  if (!is_float_dtype(x_dtype) || !(is_float_dtype(scales.dtype()) || kquant) ||
      biases.dtype() != scales.dtype())
    throw std::invalid_argument("qmm: x, scales and biases must be float32/float16/bfloat16 "
                                "(tiled: or uint8 K-quant codes)");
  const int N = w.shape(0);
  const int G = K / group_size;
  if (kquant && (!tiled || group_size != 32 || G % 8 != 0 || K % group_size != 0 ||
                 scales.shape() != mx::Shape({N, G / 8 * 10}) || biases.shape() != scales.shape()))
    throw std::invalid_argument("qmm: K-quant codes need tiled weights, groups of 32 in 8s "
                                "and scales and biases (N, K / 256 * 10) uint8");
  if (tiled && (N % 16 != 0 || group_size % 32 != 0 || !tiled_supported()))
    throw std::invalid_argument("qmm: tiled weights need rows in 16s, groups of 32s and "
                                "AVX-512 VNNI");
  if (scaled_biases(biases, scales) && !tiled)
    throw std::invalid_argument("qmm: a (1, 1) bias factor needs tiled weights");
  if (K % group_size != 0 || int64_t(w.shape(1)) * 32 / bits != K ||
      scales.shape(0) != N || (scales.shape(1) != K / group_size && !kquant) ||
      (biases.shape() != scales.shape() && !scaled_biases(biases, scales)))
    throw std::invalid_argument("qmm: shapes of x " + std::to_string(K) +
                                " and w/scales/biases do not match");
}

mx::array qmm(const mx::array& x, const mx::array& w, const mx::array& scales,
              const mx::array& biases, int group_size, int bits, bool tiled,
              mx::StreamOrDevice s) {
  if (x.ndim() < 1) throw std::invalid_argument("qmm: x needs >= 1 dims; w, scales, biases 2");
  check_qmm(x.shape(-1), x.dtype(), w, scales, biases, group_size, bits, tiled);
  auto shape = x.shape();
  shape.back() = w.shape(0);
  const mx::Dtype dtype = mx::promote_types(x.dtype(), param_dtype(scales));
  auto stream = mx::to_stream(s, mx::Device::cpu);
  return mx::array(shape, dtype, std::make_shared<QuantizedMatmul>(stream, group_size, bits, tiled),
                   {x, w, scales, biases});
}

}  // namespace kvchat
