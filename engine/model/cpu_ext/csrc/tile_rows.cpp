// `ops.tile`'s re-layout of 4/8-bit weights as one op. MLX's CPU ops did it at ~65 M
// weights a second (shifts, a 6-d transpose, an or): ~38 s of a 64-expert model's load,
// every load. The loops below write the same bytes (tested against the MLX version).
#include <cstring>
#include <stdexcept>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "pool.h"
#include "tensor.h"
#include "tile_rows.h"

namespace kvchat {

namespace {

// Tile t's bytes: 4 bits, (g, p, i, b) <- row 16t + i's weights g G + 8p + b (low nibble)
// and g G + 8p + 4 + b (high); 8 bits, (g, j, i, b) <- row 16t + i's weight g G + 4j + b.
void tile_one(const uint8_t* w, uint8_t* out, int64_t t, int64_t row_bytes, int group,
              int bits, int64_t G) {
  const uint8_t* rows = w + t * kTileRows * row_bytes;
  if (bits == 8) {
    const int J = group / 4;
    for (int64_t g = 0; g < G; ++g)
      for (int j = 0; j < J; ++j)
        for (int i = 0; i < kTileRows; ++i, out += 4)
          std::memcpy(out, rows + i * row_bytes + g * group + 4 * j, 4);
    return;
  }
  const int P = group / 8;
  for (int64_t g = 0; g < G; ++g)
    for (int p = 0; p < P; ++p)
      for (int i = 0; i < kTileRows; ++i) {
        // 8 weights g G + 8p .. + 7 are 4 bytes of the row (two nibbles a byte, low first)
        const uint8_t* src = rows + i * row_bytes + (g * group + 8 * p) / 2;
        for (int b = 0; b < 4; ++b, ++out) {
          const int lo = b, hi = 4 + b;  // weights 8p + b and 8p + 4 + b
          const uint8_t wl = (src[lo / 2] >> (4 * (lo % 2))) & 0xF;
          const uint8_t wh = (src[hi / 2] >> (4 * (hi % 2))) & 0xF;
          *out = uint8_t(wl | (wh << 4));
        }
      }
}

}  // namespace

void TileRows::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  encoder.set_input_array(inputs[0]);
  encoder.set_output_array(out);
  encoder.dispatch([w = inputs[0], out, group = group_, bits = bits_]() mutable {
    std::vector<char> buf;
    const auto* src = static_cast<const uint8_t*>(row_major(w, buf));
    const int64_t N = w.shape(0), row_bytes = int64_t(w.shape(1)) * 4;
    const int64_t K = row_bytes * 8 / bits, G = K / group, T = N / kTileRows;
    auto* dst = out.data<uint8_t>();
    ThreadPool::instance().run(int(T), [&](int t) {
      tile_one(src, dst + t * kTileRows * row_bytes, t, row_bytes, group, bits, G);
    });
  });
}

void TileRows::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("KvchatTileRows runs on the CPU only");
}

mx::array tile_rows(const mx::array& w, int group, int bits, mx::StreamOrDevice s) {
  if (bits != 4 && bits != 8) throw std::invalid_argument("tile_rows: 4 or 8 bits");
  if (group != 32 && group != 64 && group != 128)
    throw std::invalid_argument("tile_rows: group 32, 64 or 128");
  if (w.ndim() != 2 || w.dtype() != mx::uint32 || w.shape(0) % kTileRows != 0 ||
      (int64_t(w.shape(1)) * 32 / bits) % group != 0)
    throw std::invalid_argument("tile_rows: w (N, K * bits / 32) uint32, N a multiple of 16, "
                                "K of whole groups");
  auto stream = mx::to_stream(s, mx::Device::cpu);
  return mx::array(w.shape(), mx::uint32, std::make_shared<TileRows>(stream, group, bits), {w});
}

}  // namespace kvchat
