// kvchat's CPU primitives for MLX: a quantized matmul (decode GEMV and
// prefill GEMM) and paged attention (decode and causal prefill) that reads the
// block table.
#pragma once

#include <optional>

#include "mlx/array.h"
#include "mlx/primitives.h"
#include "mlx/stream.h"
#include "mlx/utils.h"
#include "paged_decode_kernel.h"

namespace kvchat {

namespace mx = mlx::core;

// y = x @ dequantize(w, scales, biases).T, the semantics of
// mx.quantized_matmul(..., transpose=True) for MLX affine quantization.
// `tiled`: weights in kvchat's tiled layout, multiplied with int16 x
// (qmm_tiled.cpp).
mx::array qmm(const mx::array& x, const mx::array& w, const mx::array& scales,
              const mx::array& biases, int group_size, int bits, bool tiled = false,
              mx::StreamOrDevice s = {});

// Attention straight from a block-paged pool; see engine/model/attention
// for the contract: queries (B, Hq, L, D) are each sequence's L newest positions,
// causal (L == 1 is decode). k / v are float pools (Hkv, num_blocks, block_size, D)
// or packed uint32 rows with their scales and biases (Hkv, num_blocks, block_size,
// D / group); or either as stored, 3-d (Hkv, num_blocks * block_size, .), with
// `block_size` given (no reshape node in the step's graph).
mx::array paged_attention(const mx::array& queries, const mx::array& k, const mx::array& v,
                          const mx::array& block_tables, const mx::array& context_lens,
                          float scale, const std::optional<mx::array>& k_scales,
                          const std::optional<mx::array>& k_biases, int k_bits, int k_group,
                          const std::optional<mx::array>& v_scales,
                          const std::optional<mx::array>& v_biases, int v_bits, int v_group,
                          int window = 0, const std::optional<mx::array>& sinks = std::nullopt,
                          const std::optional<mx::array>& rotation = std::nullopt,
                          bool rotate_queries = false, bool unrotate_out = false,
                          int block_size = 0, mx::StreamOrDevice s = {});

// `pool` (H, S, ...) with rows (H, N, ...) written at `slots` (N,): one node, in place
// when the pool is donated (kv_write.cpp). Float rows are cast to a float pool's dtype;
// any other pool takes rows of its own dtype.
mx::array kv_write(const mx::array& pool, const mx::array& slots, const mx::array& rows,
                   mx::StreamOrDevice s = {});

// Per-channel key quantization of the blocks a residual pool's write filled: residual
// rows res (H, R * block_size, D) at block rows `at` (n,), rotated when signs are given ->
// [codes (H, n, D, block_size * bits / 8) uint8, scales, biases (H, n, D) float16], bit for
// bit `channel_quant.quantize_channels` of `rotation.rotate`'s rows (channel_quant.cpp).
std::vector<mx::array> channel_quant(const mx::array& res, const mx::array& at, int block_size,
                                     int bits, const std::optional<mx::array>& signs,
                                     mx::StreamOrDevice s = {});

// Each row's greedy token where it provably equals mlx-lm's
// argmax(logits - logsumexp(logits)), else -1 (greedy.cpp): (rows, vocab) -> int32.
mx::array greedy_pick(const mx::array& logits, mx::StreamOrDevice s = {});

// A short description of the compiled SIMD path and pool size (diagnostics).
const char* build_info();

class QuantizedMatmul : public mx::UnaryPrimitive {
 public:
  QuantizedMatmul(mx::Stream stream, int group_size, int bits, bool tiled)
      : mx::UnaryPrimitive(stream), group_size_(group_size), bits_(bits), tiled_(tiled) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override {
    return "KvchatQuantizedMatmul";
  }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  int group_size_;
  int bits_;
  bool tiled_;
};

class KvWrite : public mx::UnaryPrimitive {
 public:
  explicit KvWrite(mx::Stream stream) : mx::UnaryPrimitive(stream) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override {
    return "KvchatKvWrite";
  }
  bool is_equivalent(const mx::Primitive&) const override {
    return true;
  }
};

class GreedyPick : public mx::UnaryPrimitive {
 public:
  explicit GreedyPick(mx::Stream stream) : mx::UnaryPrimitive(stream) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override {
    return "KvchatGreedyPick";
  }
  bool is_equivalent(const mx::Primitive&) const override {
    return true;
  }
};

// Rows `rows` (int32, any shape) of a tiled 8-bit embedding (ops.py's `tile`), dequantized
// as mx.dequantize gives them -> rows.shape + (K,) in the scales' dtype (embed_rows.cpp).
mx::array tiled_rows8(const mx::array& w, const mx::array& scales, const mx::array& biases,
                      const mx::array& rows, int group_size, mx::StreamOrDevice s = {});

class TiledRows8 : public mx::UnaryPrimitive {
 public:
  TiledRows8(mx::Stream stream, int group) : mx::UnaryPrimitive(stream), group_(group) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override {
    return "KvchatTiledRows8";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    return group_ == static_cast<const TiledRows8&>(other).group_;
  }

 private:
  int group_;
};

struct QuantSide {
  int bits = 0;  // 0: float rows
  int group = 0;
  bool operator==(const QuantSide&) const = default;
};

// One pool side as the decode kernels read it: float rows, or packed rows with their scales
// and biases (`quant.bits` 4/8); `bufs[0..2]` hold row-major copies where an input is not
// (paged_attention.cpp).
Side make_side(const mx::array& rows, const mx::array* scales, const mx::array* biases,
               QuantSide quant, int D, std::vector<char>* bufs);

class PagedAttention : public mx::UnaryPrimitive {
 public:
  PagedAttention(mx::Stream stream, float scale, QuantSide k, QuantSide v, int window,
                 bool sinks, bool rotate_queries, bool unrotate_out, int block_size)
      : mx::UnaryPrimitive(stream), scale_(scale), k_(k), v_(v), window_(window),
        sinks_(sinks), rotate_q_(rotate_queries), unrotate_out_(unrotate_out),
        block_size_(block_size) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override {
    return "KvchatPagedAttention";
  }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  float scale_;
  QuantSide k_, v_;
  int window_;  // a sliding window (0: none)
  bool sinks_;  // the last input is (Hq,) float32 sinks
  // A rotated pool (`kvcache.rotation`): queries times R before, outputs times R^T after,
  // inside the op (the input before the sinks: R's (D,) signs)
  bool rotate_q_, unrotate_out_;
  int block_size_;  // pools given 3-d, as stored (0: 4-d)
};

}  // namespace kvchat
