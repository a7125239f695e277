// A decode step's run of llama-family layers built in C++ (layer_stack.cpp): the same
// graph the runner builds layer by layer in Python (`layer_head`, the K/V writes,
// `paged_attention`, `layer_tail`), node for node, without ~50 us of Python per layer.
#pragma once

#include <optional>
#include <tuple>
#include <vector>

#include "layer_ops.h"

namespace kvchat {

// One layer's arrays and settings, as `ExtLayer` holds them, plus its attention scale.
struct StackLayer {
  mx::array in_norm;
  float in_eps;
  std::vector<mx::array> qkv;  // (w, scales, biases) of one fused projection or three
  std::vector<LinearSpec> qkv_specs;
  RopeParams rope;
  std::optional<mx::array> freqs;
  std::vector<mx::array> o, gate_up, down;  // (w, scales, biases) each
  LinearSpec o_spec, gate_up_spec, down_spec;
  mx::array post_norm;
  float post_eps;
  float scale;  // softmax scale (plain attention: no window, no sinks)
};

class LayerStack {
 public:
  LayerStack(int heads, int kv_heads, int block_size)
      : heads_(heads), kv_heads_(kv_heads), block_size_(block_size) {}
  void add(StackLayer layer) { layers_.push_back(std::move(layer)); }
  int size() const { return int(layers_.size()); }

  // Layers first..end of h (B, L, hidden) over float pools (kv_heads, slots, D), each
  // layer's new K/V written at `slots` first: (h, new keys, new values) for those layers.
  std::tuple<mx::array, std::vector<mx::array>, std::vector<mx::array>> run(
      mx::array h, const std::vector<mx::array>& keys, const std::vector<mx::array>& values,
      const mx::array& slots, const mx::array& block_tables, const mx::array& context_lens,
      const mx::array& offsets, int first) const;

 private:
  int heads_, kv_heads_, block_size_;
  std::vector<StackLayer> layers_;
};

}  // namespace kvchat
