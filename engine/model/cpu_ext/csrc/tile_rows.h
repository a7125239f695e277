// `ops.tile`'s re-layout of MLX 4/8-bit weights into the tiled layout (tile_rows.cpp).
#pragma once

#include "mlx/array.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"

namespace kvchat {

namespace mx = mlx::core;

// Weight rows per tile of the layout (ops.py's TILE_ROWS).
constexpr int kTileRows = 16;

class TileRows : public mx::UnaryPrimitive {
 public:
  TileRows(mx::Stream stream, int group, int bits)
      : mx::UnaryPrimitive(stream), group_(group), bits_(bits) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override {
    return "KvchatTileRows";
  }

 private:
  int group_, bits_;
};

// w (N, K * bits / 32) uint32 as MLX packs it -> the same shape in the tiled layout
// (`ops.tile`'s docstring): 4 or 8 bits, N a multiple of 16.
mx::array tile_rows(const mx::array& w, int group, int bits, mx::StreamOrDevice s = {});

}  // namespace kvchat
