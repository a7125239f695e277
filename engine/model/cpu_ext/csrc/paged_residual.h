// Attention over a residual-format pool (engine/kvcache/residual.py): full blocks
// quantized (keys per channel within the block, values per token), each sequence's
// residual blocks exact in the compute dtype (paged_residual.cpp).
#pragma once

#include <optional>

#include "mlx/array.h"
#include "mlx/primitives.h"
#include "mlx/stream.h"
#include "mlx/utils.h"

namespace kvchat {

namespace mx = mlx::core;

// queries (B, Hq, L, D): each sequence's L newest positions (L = 1: decode, else a causal
// prefill chunk); k_codes (Hkv, nb, D, BS * k_bits / 8) uint8 with k_scales /
// k_biases (Hkv, nb, D); v_rows (Hkv, nb, BS, D * v_bits / 32) uint32 with v_scales /
// v_biases (Hkv, nb, BS, D / v_group); res_k / res_v (Hkv, nres, BS, D) float; res_map
// (nb,) int32: a block's residual row or -1; block_tables (B, ·), context_lens (B,) int32.
// A row's own (newest) block is read exact where res_map maps it, every other block
// quantized (the rule is by position); window > 0: a row sees its last `window` positions
// only. rotate_k / rotate_v: the quantized side is stored
// times R (`rotation`: R's (D,) signs); the residual rows never are. block_size > 0: v_rows,
// v_scales, v_biases, res_k and res_v come 3-d as stored, (H, blocks * block_size, .).
mx::array paged_residual(
    const mx::array& queries, const mx::array& k_codes, const mx::array& k_scales,
    const mx::array& k_biases, const mx::array& v_rows, const mx::array& v_scales,
    const mx::array& v_biases, const mx::array& res_k, const mx::array& res_v,
    const mx::array& res_map, const mx::array& block_tables, const mx::array& context_lens,
    float scale, int k_bits, int v_bits, int v_group,
    const std::optional<mx::array>& sinks = std::nullopt,
    const std::optional<mx::array>& rotation = std::nullopt, bool rotate_k = false,
    bool rotate_v = false, int window = 0, int block_size = 0, mx::StreamOrDevice s = {});

class PagedResidual : public mx::UnaryPrimitive {
 public:
  PagedResidual(mx::Stream stream, float scale, int k_bits, int v_bits, int v_group,
                int window, int block_size, bool sinks, bool rotate_k, bool rotate_v)
      : mx::UnaryPrimitive(stream), scale_(scale), k_bits_(k_bits), v_bits_(v_bits),
        v_group_(v_group), window_(window), block_size_(block_size), sinks_(sinks),
        rotate_k_(rotate_k), rotate_v_(rotate_v) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override {
    return "KvchatPagedResidual";
  }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  float scale_;
  int k_bits_, v_bits_, v_group_, window_, block_size_;
  bool sinks_, rotate_k_, rotate_v_;
};

}  // namespace kvchat
