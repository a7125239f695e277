// Rows of a tiled 8-bit embedding, dequantized, as one op (the token lookup of a step).
//
// `ops.lookup_rows` builds the same lookup from MLX ops (views, transposes, gathers of the
// tiled bytes, scales and biases, then `mx.dequantize`): ~20 nodes, 0.1 ms of graph
// building and ~0.18 ms of tiny tasks a decode step on the 2-core Xeon. Each value is MLX's
// CPU dequantize to the bit: code x scale rounded to the scales' dtype, plus the bias rounded
// again (two ops, no fused multiply-add: contraction is off in this file). A symmetric
// format's biases are one factor (a (1, 1) array): a group's bias is its scale times it,
// rounded to the dtype, as `ops.untile_rows` makes them (``s * factor``) for `mx.dequantize`.
#pragma GCC optimize("fp-contract=off")

#include <algorithm>
#include <limits>
#include <stdexcept>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "ops.h"
#include "tensor.h"
#include "tile_rows.h"

namespace kvchat {

namespace {

// A group's bias: its own, or (`factor`) its scale times the one factor, rounded to `e`.
float group_bias(const void* scales, const void* biases, Elem e, int64_t at, bool factor) {
  if (!factor) return scalar_any(biases, e, at);
  const float b = scalar_any(scales, e, at) * scalar_any(biases, e, 0);
  alignas(4) char rounded[4];
  store_any(rounded, e, &b, 1);
  return scalar_any(rounded, e, 0);
}

// Row `r` (of N) into `out` (K values of the scales' type `e`). Tiled bytes: (tile, group,
// quad, row in tile, byte); scales and biases: (tile, group, row in tile), or one factor.
void embed_row(const uint8_t* w, const void* scales, const void* biases, bool factor, Elem e,
               int64_t r, int64_t G, int group, float* prod, float* sum, void* out) {
  const int64_t t = r / kTileRows, i = r % kTileRows, K = G * group;
  for (int64_t g = 0; g < G; ++g) {
    const float s = scalar_any(scales, e, (t * G + g) * kTileRows + i);
    const uint8_t* q = w + (t * G + g) * int64_t(group) * kTileRows + i * 4;
    for (int p = 0; p < group / 4; ++p)
      for (int b = 0; b < 4; ++b) prod[g * group + 4 * p + b] = float(q[p * 4 * kTileRows + b]) * s;
  }
  store_any(out, e, prod, K);  // the product rounded to the dtype, as MLX's multiply
  for (int64_t g = 0; g < G; ++g) {
    const float b = group_bias(scales, biases, e, (t * G + g) * kTileRows + i, factor);
    for (int k = 0; k < group; ++k) sum[g * group + k] = scalar_any(out, e, g * group + k) + b;
  }
  store_any(out, e, sum, K);  // and the sum, as MLX's add
}

}  // namespace

void TiledRows8::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& a : inputs) encoder.set_input_array(a);
  encoder.set_output_array(out);
  encoder.dispatch([inputs, out, group = group_]() mutable {
    guarded(out, [&] {
      std::vector<char> sw, ss, sb, sr;
      const auto* w = static_cast<const uint8_t*>(row_major(inputs[0], sw));
      const void* scales = row_major(inputs[1], ss);
      const void* biases = row_major(inputs[2], sb);
      const auto* rows = static_cast<const int32_t*>(row_major(inputs[3], sr));
      const Elem e = elem_of(out.dtype());
      const int64_t N = inputs[1].shape(0), G = inputs[1].shape(1), K = G * group;
      const size_t bytes = mx::size_of(out.dtype());
      std::vector<float> prod(K), sum(K);
      char* dst = out.data<char>();
      for (int64_t n = 0; n < int64_t(inputs[3].size()); ++n) {
        void* row_out = dst + n * K * bytes;
        if (rows[n] < 0 || rows[n] >= N) {  // never a valid token: no row to read
          std::fill(prod.begin(), prod.end(), std::numeric_limits<float>::quiet_NaN());
          store_any(row_out, e, prod.data(), K);
          continue;
        }
        embed_row(w, scales, biases, inputs[2].size() == 1, e, rows[n], G, group, prod.data(),
                  sum.data(), row_out);
      }
    });
  });
}

void TiledRows8::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("KvchatTiledRows8 runs on the CPU only");
}

mx::array tiled_rows8(const mx::array& w, const mx::array& scales, const mx::array& biases,
                      const mx::array& rows, int group_size, mx::StreamOrDevice s) {
  const bool factor = biases.shape() == mx::Shape{1, 1};
  if (w.ndim() != 2 || w.dtype() != mx::uint32 || scales.ndim() != 2 ||
      (biases.shape() != scales.shape() && !factor) || biases.dtype() != scales.dtype() ||
      !is_float_dtype(scales.dtype()))
    throw std::invalid_argument("tiled_rows8: w (N, K / 4) uint32, scales (N, G) and biases "
                                "(N, G) or (1, 1) of one float dtype");
  const int64_t N = w.shape(0), K = int64_t(w.shape(1)) * 4;
  if (group_size <= 0 || group_size % 4 != 0 || scales.shape(0) != N || N % kTileRows != 0 ||
      K != int64_t(scales.shape(1)) * group_size)
    throw std::invalid_argument("tiled_rows8: N a multiple of 16, K = groups x group_size");
  if (rows.dtype() != mx::int32)
    throw std::invalid_argument("tiled_rows8: rows must be int32");
  auto shape = rows.shape();
  shape.push_back(int(K));
  return mx::array(shape, scales.dtype(),
                   std::make_shared<TiledRows8>(mx::to_stream(s, mx::Device::cpu), group_size),
                   {w, scales, biases, rows});
}

}  // namespace kvchat
