// RMSNorm, RoPE and SwiGLU primitives (the semantics of mx.fast.rms_norm /
// mx.fast.rope / mlx-lm's swiglu).
#pragma once

#include <cmath>
#include <optional>
#include <vector>

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

// The fallback's frequencies, in float32 like it: exp(-i * log(base) / half), or, for
// given frequencies (Llama 3's scaled ones), their reciprocals as mx.fast.rope takes them.
inline std::vector<float> rope_inv_freq(const RopeParams& p, const float* freqs = nullptr) {
  const int half = p.dims / 2;
  std::vector<float> inv_freq(half);
  const float step = std::log(p.base) / float(half);
  for (int i = 0; i < half; ++i)
    inv_freq[i] = freqs ? 1.0f / freqs[i] : std::exp(-float(i) * step);
  return inv_freq;
}

// The float32 frequencies of an optional (dims / 2,) input, or nullptr.
const float* freqs_of(const mx::array* freqs, std::vector<float>& buf);

// cos, sin of every frequency at `position` (interleaved in `cs`, 2 * half floats).
inline void rope_angles(const RopeParams& p, const std::vector<float>& inv_freq,
                        float position, float* cs) {
  const float pos = position * p.scale;
  for (size_t i = 0; i < inv_freq.size(); ++i) {
    const float theta = pos * inv_freq[i];
    cs[2 * i] = std::cos(theta);
    cs[2 * i + 1] = std::sin(theta);
  }
}

// Rotate one head's row (float32, in place) by the angles of `rope_angles`.
inline void rope_rotate(const RopeParams& p, const float* cs, float* row) {
  const int half = p.dims / 2;
  for (int i = 0; i < half; ++i) {
    const int i1 = p.traditional ? 2 * i : i;
    const int i2 = p.traditional ? 2 * i + 1 : i + half;
    const float x1 = row[i1], x2 = row[i2], c = cs[2 * i], s = cs[2 * i + 1];
    row[i1] = x1 * c - x2 * s;
    row[i2] = x1 * s + x2 * c;
  }
}

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

// The activation of a gated MLP: act(gate) * up (swiglu.cpp).
// The row-wise float32 binary op: silu(g) * u, gelu_approx(g) * u, or (clip_add) Gemma 3's
// float16 residual sum, clip(g + u) to float16's range.
enum class GateAct { silu, gelu_tanh, clip_add };

class Swiglu : public mx::UnaryPrimitive {
 public:
  Swiglu(mx::Stream stream, GateAct act) : mx::UnaryPrimitive(stream), act_(act) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override {
    return act_ == GateAct::silu        ? "KvchatSwiglu"
           : act_ == GateAct::gelu_tanh ? "KvchatGeluTanhMul"
                                        : "KvchatClipAdd";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    return static_cast<const Swiglu&>(other).act_ == act_;
  }

 private:
  GateAct act_;
};

// x / sqrt(mean(x^2) + eps) * weight over the last axis, in float32.
mx::array rms_norm(const mx::array& x, const mx::array& weight, float eps,
                   mx::StreamOrDevice s = {});

// Rotary embedding of x (B, H, L, D) at positions offset + 0..L-1 (offsets: int32,
// one, or one per batch row), as mx.fast.rope computes it; `freqs` (dims / 2,) float32
// replace the base's (as mx.fast.rope's freqs, e.g. mlx-lm's Llama3RoPE).
mx::array rope(const mx::array& x, const mx::array& offsets, int dims, bool traditional,
               float base, float scale, const std::optional<mx::array>& freqs = std::nullopt,
               mx::StreamOrDevice s = {});

// Checks an optional freqs argument against dims (std::invalid_argument when it does not
// fit): float32, (dims / 2,).
void check_freqs(const std::optional<mx::array>& freqs, int dims, const char* op);

// silu(gate) * up elementwise (swiglu.cpp), in float32; gate and up of one shape.
mx::array swiglu(const mx::array& gate, const mx::array& up, mx::StreamOrDevice s = {});

// gelu_approx(gate) * up elementwise (mlx-lm's Gemma 3 MLP: the tanh GELU), in float32.
mx::array gelu_tanh_mul(const mx::array& gate, const mx::array& up, mx::StreamOrDevice s = {});
// clip(x + y) to float16's range, summed in float32, as float16 (mlx-lm's Gemma 3
// clip_residual for a float16 x).
mx::array clip_add(const mx::array& x, const mx::array& y, mx::StreamOrDevice s = {});

}  // namespace kvchat
