// Parts the fused layer ops share (layer_ops.cpp, gemma_tail.cpp): their scratch, the
// attention output's rows, the linears and how many rows a tail takes a pass.
#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "layer_ops.h"
#include "kernels.h"
#include "mlx/allocator.h"

namespace kvchat {

// An evaluated array to compute into (when an op is queued, or inside its task: see
// queued_scratch_rows).
mx::array scratch(mx::Shape shape, mx::Dtype dtype) {
  mx::array a(std::move(shape), dtype, nullptr, {});
  a.set_data(mx::allocator::malloc(a.nbytes()));
  return a;
}

// Rows m0..m1 of att (B, H, L, D) as rows (m1 - m0, H * D): att.transpose(0, 2, 1, 3)
// .reshape(B * L, H * D)[m0:m1]. `src` is att's row-major bytes.
void heads_to_rows(const char* src, const mx::array& att, int64_t m0, int64_t m1,
                   mx::array& rows) {
  const int64_t H = att.shape(1), L = att.shape(2), D = att.shape(3);
  const size_t row = size_t(D) * att.itemsize();
  char* dst = rows.data<char>();
  for (int64_t m = m0; m < m1; ++m) {
    const int64_t b = m / L, l = m % L;
    for (int64_t h = 0; h < H; ++h)
      std::memcpy(dst + ((m - m0) * H + h) * row, src + ((b * H + h) * L + l) * row, row);
  }
}

void linear(const mx::array& x, const mx::array* wsb, mx::array& out, const LinearSpec& sp) {
  qmm_into(x, wsb[0], wsb[1], wsb[2], out, sp.group, sp.bits, sp.tiled);
}

mx::Dtype after(const mx::array& x, const mx::array& scales) {
  return mx::promote_types(x.dtype(), param_dtype(scales));
}

// Rows per pass of a tail whose linears are all tiled: the MLP's activations (2 F + F
// floats a row, 48 kB for a 1B model) then exist for this many rows, not a whole prefill
// chunk's (~70 MB at 512 tokens of a 1B model). Tiled matmuls give a row the same bits
// whatever rows run with it, so the result does not change; other linears take all rows
// in one pass (their GEMV/GEMM choice depends on the row count). 64 rather than 128:
// a Gemma-shaped 1B prefill peaked 8 MB lower (RSS) at no measured prefill cost
// (1B Q4_0 and the default model, 3 runs each). KVCHAT_TAIL_ROWS overrides it, to measure.
int64_t tail_rows(bool tiled, int64_t M) {
  static const int64_t n = [] {
    const char* env = std::getenv("KVCHAT_TAIL_ROWS");
    return env && std::atoi(env) > 0 ? int64_t(std::atoi(env)) : int64_t(64);
  }();
  return tiled ? std::min(M, n) : M;
}

int64_t queued_scratch_rows() {
  static const int64_t n = [] {
    const char* env = std::getenv("KVCHAT_QUEUED_ROWS");
    return env ? int64_t(std::atoi(env)) : int64_t(16);
  }();
  return n;
}

}  // namespace kvchat
