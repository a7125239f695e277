// A llama-family layer on the CPU in two nodes around attention (layer_ops.cpp):
// `layer_head` (input norm, fused q/k/v projection, RoPE) and `layer_tail` (o_proj,
// residual, post-attention norm, gate/up, SwiGLU, down, residual).
#pragma once

#include <vector>

#include "mlx/array.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"
#include "norm_rope.h"
#include "tensor.h"

namespace kvchat {

namespace mx = mlx::core;

// How one quantized linear is stored (the arguments of `qmm`).
struct LinearSpec {
  int group, bits;
  bool tiled;
  bool operator==(const LinearSpec&) const = default;
};

// Parts the fused layer ops share (layer_parts.cpp).
// An evaluated array to compute into.
mx::array scratch(mx::Shape shape, mx::Dtype dtype);
// Rows up to which an op takes its scratch when it is queued (16: a decode's, small, taken
// while the previous task still runs); above it the dispatched task takes its own, since
// MLX queues layers ahead of the stream and queued prefill buffers were alive for several
// layers at once (a Gemma prefill step's peak 36 -> 22 MiB). KVCHAT_QUEUED_ROWS overrides
// it, to measure.
int64_t queued_scratch_rows();
// The first n rows of a row-major (rows, cols) array, sharing its buffer.
inline mx::array first_rows(const mx::array& full, int n) {
  return shared_view(full, {n, full.shape(-1)});
}
// Rows m0..m1 of att (B, H, L, D), row-major bytes at src, as rows (m1 - m0, H * D).
void heads_to_rows(const char* src, const mx::array& att, int64_t m0, int64_t m1,
                   mx::array& rows);
// out = qmm(x, w, scales, biases) of `wsb`'s three arrays.
void linear(const mx::array& x, const mx::array* wsb, mx::array& out, const LinearSpec& sp);
// The dtype `qmm` gives x by a layer with these scales.
mx::Dtype after(const mx::array& x, const mx::array& scales);
// Rows per pass of a tail of M rows (128 when its linears are all tiled, else M).
int64_t tail_rows(bool tiled, int64_t M);

class LayerHead : public mx::Primitive {
 public:
  LayerHead(mx::Stream stream, float eps, std::vector<LinearSpec> qkv, int heads, int kv_heads,
            RopeParams rope)
      : mx::Primitive(stream), eps_(eps), qkv_(std::move(qkv)), heads_(heads),
        kv_heads_(kv_heads), rope_(rope) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override {
    return "KvchatLayerHead";
  }

 private:
  float eps_;
  std::vector<LinearSpec> qkv_;  // one fused projection, or q, k and v apart
  int heads_, kv_heads_;
  RopeParams rope_;
};

class LayerTail : public mx::UnaryPrimitive {
 public:
  LayerTail(mx::Stream stream, float eps, LinearSpec o, LinearSpec gate_up, LinearSpec down)
      : mx::UnaryPrimitive(stream), eps_(eps), o_(o), gate_up_(gate_up), down_(down) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override {
    return "KvchatLayerTail";
  }

 private:
  float eps_;
  LinearSpec o_, gate_up_, down_;
};

// h (B, L, hidden) -> [q (B, heads, L, D), k, v (kv_heads, B * L, D)]: rms_norm(h,
// norm, eps), then `qmm` by the q/k/v weights (`qkv`: (w, scales, biases) of one fused
// projection, or of q, k and v apart, one spec each: a K-quant file's v may have other
// bits), then RoPE of q and k at offsets (`freqs` as `rope` takes them); each step
// rounded to the dtype its own op would give.
std::vector<mx::array> layer_head(const mx::array& h, const mx::array& norm,
                                  const std::vector<mx::array>& qkv,
                                  const std::vector<LinearSpec>& specs,
                                  const mx::array& offsets, float eps, int heads,
                                  int kv_heads, RopeParams rope,
                                  const std::optional<mx::array>& freqs = std::nullopt,
                                  mx::StreamOrDevice s = {});

// h (B0, L0, hidden) and attention's output att (B, heads, L, D), B * L == B0 * L0 rows
// in one order -> h1 + down(swiglu(gate_up(rms_norm(h1)))), h1 = h + o(att as rows);
// weights in `layer_head`'s (w, scales, biases) form, gate_up the gate rows then the up.
mx::array layer_tail(const mx::array& h, const mx::array& att,
                     const std::vector<mx::array>& o, const mx::array& norm,
                     const std::vector<mx::array>& gate_up, const std::vector<mx::array>& down,
                     float eps, LinearSpec o_spec, LinearSpec gate_up_spec, LinearSpec down_spec,
                     mx::StreamOrDevice s = {});

}  // namespace kvchat
