// Gemma 3's layer after attention as one node (gemma_tail.cpp): o_proj, the post-attention
// norm, the float16 residual sum, the pre-MLP norm, gate and up, the tanh GELU product,
// down, the post-MLP norm and the second residual sum.
#pragma once

#include <vector>

#include "layer_ops.h"

namespace kvchat {

class GemmaTail : public mx::UnaryPrimitive {
 public:
  GemmaTail(mx::Stream stream, float eps, std::vector<LinearSpec> specs)
      : mx::UnaryPrimitive(stream), eps_(eps), specs_(std::move(specs)) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override {
    return "KvchatGemmaTail";
  }

 private:
  float eps_;
  std::vector<LinearSpec> specs_;  // o, gate, up, down
};

// h (B0, L0, hidden) float16 and attention's output att (B, heads, L, D), B * L == B0 * L0
// rows in one order -> clip_add(h1, rms_norm(down(gelu_tanh_mul(gate(x2), up(x2))), n3)),
// x2 = rms_norm(h1, n2), h1 = clip_add(h, rms_norm(o(att as rows), n1)): mlx-lm's Gemma 3
// layer after attention, each step rounded to the dtype its own op gives. The norms'
// weights are the scales Gemma uses (1 + w); linears as `layer_tail` takes them.
mx::array gemma_tail(const mx::array& h, const mx::array& att, const std::vector<mx::array>& o,
                     const std::vector<mx::array>& norms, const std::vector<mx::array>& gate,
                     const std::vector<mx::array>& up, const std::vector<mx::array>& down,
                     float eps, const std::vector<LinearSpec>& specs, mx::StreamOrDevice s = {});

}  // namespace kvchat
