// New K or V rows written into one part of a quantized pool (kv_write_quant.cpp).
#pragma once

#include <optional>

#include "mlx/array.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"

namespace kvchat {

namespace mx = mlx::core;

struct QuantWrite {
  int part;  // 0: packed rows (uint32), 1: scales, 2: biases
  int bits, group;
};

class KvWriteQuant : public mx::UnaryPrimitive {
 public:
  KvWriteQuant(mx::Stream stream, QuantWrite q) : mx::UnaryPrimitive(stream), q_(q) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override {
    return "KvchatKvWriteQuant";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    const QuantWrite& o = static_cast<const KvWriteQuant&>(other).q_;
    return q_.part == o.part && q_.bits == o.bits && q_.group == o.group;
  }

 private:
  QuantWrite q_;
};

// `part` of a quantized pool (H, S, W) with rows (H, N, D) (rotated first by kvchat's
// rotation when its (D,) signs are given) quantized as MLX's affine quantize does and written at slots (N,):
// one node, in place when the pool part is donated.
mx::array kv_write_quant(const mx::array& pool, const mx::array& slots, const mx::array& rows,
                         const std::optional<mx::array>& rotation, int part, int bits, int group,
                         mx::StreamOrDevice s = {});

}  // namespace kvchat
