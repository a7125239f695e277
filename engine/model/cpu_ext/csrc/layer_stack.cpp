// See layer_stack.h. Each layer's nodes are the ones the Python runner makes for an
// extension layer (model_runner._block with `ExtLayer`, `PagedKVCache.write`, the
// attention route's CPU kernel), built by the same C++ functions with the same arguments,
// so the outputs are the same bits (a layer's K/V writes: one `kv_write_sides` node, as
// the pool's `sides_writer` makes them).
#include "layer_stack.h"

#include <stdexcept>
#include <utility>

#include "mlx/ops.h"
#include "kv_write_parts.h"
#include "ops.h"
#include "paged_residual.h"

namespace kvchat {

namespace {

// A store as kept, (H, blocks * size, W); paged attention reads it so, with the block size.
const mx::array& stored(const mx::array& a, int size) {
  if (a.ndim() != 3 || a.shape(1) % size != 0)
    throw std::invalid_argument("layer_stack: stores must be (kv_heads, blocks * size, W)");
  return a;
}

size_t parts_of(int kind) {
  return kind == 0 ? 1 : kind == 1 ? 3 : 4;
}

// Arrays [first, last) of each side's list written with this step's rows, as one node.
void write_both(std::vector<mx::array>& k, std::vector<mx::array>& v, std::pair<int, int> at,
                const mx::array& slots, const mx::array& k_rows, const mx::array& v_rows,
                const std::optional<mx::array>& rotation, SideFormat kf, SideFormat vf) {
  const auto [first, last] = at;
  const std::vector<mx::array> ks(k.begin() + first, k.begin() + last),
      vs(v.begin() + first, v.begin() + last);
  auto out = kv_write_sides(ks, vs, slots, k_rows, v_rows, rotation, kf, vf);
  const size_t n = ks.size();
  for (size_t i = 0; i < n; ++i) {
    k[first + i] = out[i];
    v[first + i] = out[n + i];
  }
}

}  // namespace

std::tuple<mx::array, LayerStack::Sides, LayerStack::Sides> LayerStack::run(
    mx::array h, const Sides& keys, const Sides& values, const StackKV& kv,
    const mx::array& slots, const mx::array& block_tables, const mx::array& context_lens,
    const mx::array& offsets, int first) const {
  const int n = size();
  if (first < 0 || first > n || keys.size() != size_t(n - first) || values.size() != keys.size())
    throw std::invalid_argument("layer_stack: one key and one value pool per layer run");
  if (kv.kind < 0 || kv.kind > 2 || (kv.kind == 2 && !kv.res_map) ||
      ((kv.rotate_k || kv.rotate_v) && !kv.rotation))
    throw std::invalid_argument("layer_stack: kind 0-2; residual pools need their map, "
                                "rotated ones R's signs");
  const std::optional<mx::array> none;
  const auto rot = kv.rotate_k || kv.rotate_v ? kv.rotation : none;
  Sides new_keys, new_values;
  for (int i = first; i < n; ++i) {
    const StackLayer& L = layers_[i];
    const auto qkv = layer_head(h, L.in_norm, L.qkv, L.qkv_specs, offsets, L.in_eps, heads_,
                                kv_heads_, L.rope, L.freqs);
    std::vector<mx::array> k = keys[i - first], v = values[i - first];
    if (k.size() != parts_of(kv.kind) || v.size() != k.size())
      throw std::invalid_argument("layer_stack: each side's arrays as its kind stores them");
    mx::array att = qkv[0];
    if (kv.kind == 0) {
      write_both(k, v, {0, 1}, slots, qkv[1], qkv[2], none, {}, {});
      att = paged_attention(qkv[0], stored(k[0], block_size_), stored(v[0], block_size_),
                            block_tables, context_lens, L.scale, none, none, 0, 0, none, none,
                            0, 0, 0, none, none, false, false, block_size_);
    } else if (kv.kind == 1) {
      write_both(k, v, {0, 3}, slots, qkv[1], qkv[2], rot, {kv.k_bits, kv.k_group, kv.rotate_k},
                 {kv.v_bits, kv.v_group, kv.rotate_v});
      for (int p = 0; p < 3; ++p) {  // every part as kept: whole blocks
        stored(k[p], block_size_);
        stored(v[p], block_size_);
      }
      att = paged_attention(qkv[0], k[0], v[0], block_tables, context_lens, L.scale, k[1], k[2],
                            kv.k_bits, kv.k_group, v[1], v[2], kv.v_bits, kv.v_group, 0, none,
                            rot, kv.rotate_k, kv.rotate_v, block_size_);
    } else {  // full blocks as stored; only the residual rows take this step's K/V
      write_both(k, v, {3, 4}, slots, qkv[1], qkv[2], none, {}, {});
      att = paged_residual(qkv[0], k[0], k[1], k[2], stored(v[0], block_size_),
                           stored(v[1], block_size_), stored(v[2], block_size_),
                           stored(k[3], block_size_), stored(v[3], block_size_), *kv.res_map,
                           block_tables, context_lens, L.scale, kv.k_bits, kv.v_bits,
                           kv.v_group, none, rot, kv.rotate_k, kv.rotate_v, 0, block_size_);
    }
    h = layer_tail(h, att, L.o, L.post_norm, L.gate_up, L.down, L.post_eps, L.o_spec,
                   L.gate_up_spec, L.down_spec);
    new_keys.push_back(std::move(k));
    new_values.push_back(std::move(v));
  }
  return {h, new_keys, new_values};
}

}  // namespace kvchat
