// RMSNorm and RoPE primitives (the semantics of mx.fast.rms_norm / mx.fast.rope).
#pragma once

#include "mlx/array.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"

namespace kvchat {

namespace mx = mlx::core;

struct RopeParams {
  int dims;
  bool traditional;
  float base;
  float scale;
};

class RmsNorm : public mx::UnaryPrimitive {
 public:
  RmsNorm(mx::Stream stream, float eps) : mx::UnaryPrimitive(stream), eps_(eps) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override {
    return "KvchatRmsNorm";
  }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  float eps_;
};

class Rope : public mx::UnaryPrimitive {
 public:
  Rope(mx::Stream stream, RopeParams params) : mx::UnaryPrimitive(stream), params_(params) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override {
    return "KvchatRope";
  }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  RopeParams params_;
};

// x / sqrt(mean(x^2) + eps) * weight over the last axis, in float32.
mx::array rms_norm(const mx::array& x, const mx::array& weight, float eps,
                   mx::StreamOrDevice s = {});

// Rotary embedding of x (B, H, L, D) at positions offset + 0..L-1 (offsets: int32,
// one, or one per batch row), as mx.fast.rope computes it.
mx::array rope(const mx::array& x, const mx::array& offsets, int dims, bool traditional,
               float base, float scale, mx::StreamOrDevice s = {});

}  // namespace kvchat
