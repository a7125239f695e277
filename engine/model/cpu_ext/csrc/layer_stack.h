// A step's run of llama-family layers built in C++ (layer_stack.cpp): the same
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

// How a step's K/V are stored: what each layer's side lists hold, and how attention reads
// them (the nodes `PagedKVCache.write` / `block_view` and the attention route make).
struct StackKV {
  int kind = 0;  // 0: float pools [rows]; 1: quantized rows [rows, scales, biases] (per
                 // token); 2: residual -kivi [codes, scales, biases, residual rows]
  int k_bits = 0, k_group = 0, v_bits = 0, v_group = 0;
  bool rotate_k = false, rotate_v = false;
  std::optional<mx::array> rotation;  // R's (D,) signs when a side is stored rotated
  std::optional<mx::array> res_map;  // kind 2: (num_blocks,) int32, the step's map
};

class LayerStack {
 public:
  LayerStack(int heads, int kv_heads, int block_size)
      : heads_(heads), kv_heads_(kv_heads), block_size_(block_size) {}
  void add(StackLayer layer) { layers_.push_back(std::move(layer)); }
  int size() const { return int(layers_.size()); }

  using Sides = std::vector<std::vector<mx::array>>;  // per layer run, one side's arrays
  // Layers first.. of h (B, L, hidden), each layer's new K/V written at `slots` (kind 2:
  // residual slots) first: (h, the layers' keys, their values) in `keys`' form.
  std::tuple<mx::array, Sides, Sides> run(mx::array h, const Sides& keys, const Sides& values,
                                          const StackKV& kv, const mx::array& slots,
                                          const mx::array& block_tables,
                                          const mx::array& context_lens,
                                          const mx::array& offsets, int first) const;

 private:
  int heads_, kv_heads_, block_size_;
  std::vector<StackLayer> layers_;
};

}  // namespace kvchat
