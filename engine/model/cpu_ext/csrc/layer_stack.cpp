// See layer_stack.h. Each layer's nodes are the ones the Python runner makes for an
// extension layer on plain float pools (model_runner._block with `ExtLayer`), built by
// the same C++ functions with the same arguments, so the outputs are the same bits.
#include "layer_stack.h"

#include <stdexcept>

#include "mlx/ops.h"
#include "ops.h"

namespace kvchat {

std::tuple<mx::array, std::vector<mx::array>, std::vector<mx::array>> LayerStack::run(
    mx::array h, const std::vector<mx::array>& keys, const std::vector<mx::array>& values,
    const mx::array& slots, const mx::array& block_tables, const mx::array& context_lens,
    const mx::array& offsets, int first) const {
  const int n = size();
  if (first < 0 || first > n || keys.size() != size_t(n - first) || values.size() != keys.size())
    throw std::invalid_argument("layer_stack: one key and one value pool per layer run");
  std::vector<mx::array> new_keys, new_values;
  new_keys.reserve(keys.size());
  new_values.reserve(values.size());
  for (int i = first; i < n; ++i) {
    const StackLayer& L = layers_[i];
    const auto qkv = layer_head(h, L.in_norm, L.qkv, L.qkv_specs, offsets, L.in_eps, heads_,
                                kv_heads_, L.rope, L.freqs);
    const mx::array& kp = keys[i - first];
    const mx::array& vp = values[i - first];
    if (kp.ndim() != 3 || kp.shape(1) % block_size_ != 0 || vp.shape() != kp.shape())
      throw std::invalid_argument("layer_stack: pools must be (kv_heads, blocks * size, D)");
    mx::array k = kv_write(kp, slots, qkv[1]);
    mx::array v = kv_write(vp, slots, qkv[2]);
    const mx::Shape view = {kp.shape(0), kp.shape(1) / block_size_, block_size_, kp.shape(2)};
    const mx::array att = paged_attention(
        qkv[0], mx::reshape(k, view), mx::reshape(v, view), block_tables, context_lens, L.scale,
        std::nullopt, std::nullopt, 0, 0, std::nullopt, std::nullopt, 0, 0);
    h = layer_tail(h, att, L.o, L.post_norm, L.gate_up, L.down, L.post_eps, L.o_spec,
                   L.gate_up_spec, L.down_spec);
    new_keys.push_back(std::move(k));
    new_values.push_back(std::move(v));
  }
  return {h, new_keys, new_values};
}

}  // namespace kvchat
