// MoE expert matmuls (mlx-lm's gather_qmm over tiled experts) as one node (switch_qmm.cpp).
#pragma once

#include "mlx/array.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"

namespace kvchat {

namespace mx = mlx::core;

class SwitchQmm : public mx::UnaryPrimitive {
 public:
  SwitchQmm(mx::Stream stream, int group, int bits)
      : mx::UnaryPrimitive(stream), group_(group), bits_(bits) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override {
    return "KvchatSwitchQmm";
  }

 private:
  int group_, bits_;
};

// x (R, K) rows, indices (P,) int32 expert ids, R == P (one row per pair) or P == R * k
// (row r serves pairs r k .. r k + k - 1); w, scales, biases stacked per expert in the tiled
// layout (E, ...). -> (P, N): pair p's row times its expert, each expert one tiled `qmm` over
// its pairs (the rows' bits do not depend on which rows run together). An expert id outside
// 0..E-1 makes the whole output NaN.
mx::array switch_qmm(const mx::array& x, const mx::array& w, const mx::array& scales,
                     const mx::array& biases, const mx::array& indices, int group, int bits,
                     mx::StreamOrDevice s = {});

}  // namespace kvchat
