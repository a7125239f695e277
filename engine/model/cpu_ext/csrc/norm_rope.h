// RMSNorm, RoPE and SwiGLU primitives (the semantics of mx.fast.rms_norm /
// mx.fast.rope / mlx-lm's swiglu).
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

class Swiglu : public mx::UnaryPrimitive {
 public:
  explicit Swiglu(mx::Stream stream) : mx::UnaryPrimitive(stream) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override {
    return "KvchatSwiglu";
  }
  bool is_equivalent(const mx::Primitive&) const override {
    return true;
  }
};

// x / sqrt(mean(x^2) + eps) * weight over the last axis, in float32.
mx::array rms_norm(const mx::array& x, const mx::array& weight, float eps,
                   mx::StreamOrDevice s = {});

// Rotary embedding of x (B, H, L, D) at positions offset + 0..L-1 (offsets: int32,
// one, or one per batch row), as mx.fast.rope computes it.
mx::array rope(const mx::array& x, const mx::array& offsets, int dims, bool traditional,
               float base, float scale, mx::StreamOrDevice s = {});

// silu(gate) * up elementwise (swiglu.cpp), in float32; gate and up of one shape.
mx::array swiglu(const mx::array& gate, const mx::array& up, mx::StreamOrDevice s = {});

}  // namespace kvchat
