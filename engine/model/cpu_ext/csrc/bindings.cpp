// Python bindings (nanobind, in MLX's nanobind domain so mx.array passes through).
#include <nanobind/nanobind.h>
#include <stdexcept>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include "gemma_tail.h"
#include "kernels.h"
#include "kv_write_parts.h"
#include "kv_write_quant.h"
#include "layer_ops.h"
#include "layer_stack.h"
#include "norm_rope.h"
#include "ops.h"
#include "paged_residual.h"
#include "pool.h"
#include "qmm_tiled.h"
#include "switch_qmm.h"
#include "tile_rows.h"

namespace nb = nanobind;
namespace mx = mlx::core;
using namespace nb::literals;

namespace kvchat {

using Spec = std::tuple<int, int, bool>;  // a quantized linear's (group, bits, tiled)

LinearSpec spec_of(const Spec& s) {
  return {std::get<0>(s), std::get<1>(s), std::get<2>(s)};
}

const char* build_info() {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  static const char* simd = "avx512";
#elif defined(__AVX2__)
  static const char* simd = "avx2";
#elif defined(__aarch64__)
  static const char* simd = "neon";
#else
  static const char* simd = "generic";
#endif
  return simd;
}

}  // namespace kvchat

NB_MODULE(_kvchat_cpu_ext, m) {
  m.doc() = "kvchat CPU primitives for MLX (quantized matmul, paged attention)";
  m.def("qmm", &kvchat::qmm, "x"_a, "w"_a, "scales"_a, "biases"_a, nb::kw_only(),
        "group_size"_a, "bits"_a, "tiled"_a = false, "stream"_a = nb::none(),
        "x @ dequantize(w, scales, biases).T (MLX affine quantization), float32 accumulation;\n"
        "tiled: 4/8-bit weights in kvchat's tiled layout, x multiplied as int16 (AVX-512 VNNI);\n"
        "then biases may be (1, 1): one factor, each bias that times its scale (symmetric).");
  m.def("tiled_supported", &kvchat::tiled_supported,
        "Whether this build has the tiled int16-x matmul (AVX-512 VNNI).");
  m.def("set_activation_bits", &kvchat::set_activation_bits, "bits"_a,
        "How the tiled matmul quantizes x per group: 16 (default) or 8 (llama.cpp's Q8_0\n"
        "way, twice the multiply rate); process-wide, read when a product runs.");
  m.def("activation_bits", &kvchat::activation_bits, "The tiled matmul's x bits (8 or 16).");
  m.def("paged_attention", &kvchat::paged_attention, "queries"_a, "k"_a, "v"_a,
        "block_tables"_a, "context_lens"_a, nb::kw_only(), "scale"_a, "k_scales"_a = nb::none(),
        "k_biases"_a = nb::none(), "k_bits"_a = 0, "k_group"_a = 0, "v_scales"_a = nb::none(),
        "v_biases"_a = nb::none(), "v_bits"_a = 0, "v_group"_a = 0, "window"_a = 0,
        "sinks"_a = nb::none(), "rotation"_a = nb::none(), "rotate_queries"_a = false,
        "unrotate_out"_a = false, "block_size"_a = 0, "stream"_a = nb::none(),
        "Causal attention of each sequence's L newest positions over a block-paged K/V pool\n"
        "(L == 1: decode; see engine/model/attention); a rotated pool's queries and outputs\n"
        "rotated inside the op (rotation: R's (D,) signs, `kvcache.rotation`); pools 3-d as\n"
        "stored (Hkv, blocks * block_size, .) with block_size given.");
  m.def("paged_residual", &kvchat::paged_residual, "queries"_a, "k_codes"_a,
        "k_scales"_a, "k_biases"_a, "v_rows"_a, "v_scales"_a, "v_biases"_a, "res_k"_a,
        "res_v"_a, "res_map"_a, "block_tables"_a, "context_lens"_a, nb::kw_only(), "scale"_a,
        "k_bits"_a, "v_bits"_a, "v_group"_a, "sinks"_a = nb::none(), "rotation"_a = nb::none(),
        "rotate_k"_a = false, "rotate_v"_a = false, "window"_a = 0, "block_size"_a = 0,
        "stream"_a = nb::none(),
        "Attention of each sequence's L newest queries (decode: L = 1; prefill: causal) over\n"
        "a residual-format pool (engine/kvcache/residual.py): the blocks before a query's\n"
        "own quantized (keys per channel, values per token), its own block exact; per-row\n"
        "stores 3-d as kept (H, blocks * block_size, .) with block_size given.");
  m.def("rms_norm", &kvchat::rms_norm, "x"_a, "weight"_a, nb::kw_only(), "eps"_a,
        "stream"_a = nb::none(), "RMSNorm over the last axis (mx.fast.rms_norm), one op.");
  m.def("rope", &kvchat::rope, "x"_a, "offsets"_a, nb::kw_only(), "dims"_a, "traditional"_a,
        "base"_a, "scale"_a, "freqs"_a = nb::none(), "stream"_a = nb::none(),
        "Rotary embedding of (B, H, L, D) (mx.fast.rope), one op.");
  m.def("swiglu", &kvchat::swiglu, "gate"_a, "up"_a, nb::kw_only(), "stream"_a = nb::none(),
        "silu(gate) * up (mlx-lm's swiglu), one op.");
  m.def("gelu_tanh_mul", &kvchat::gelu_tanh_mul, "gate"_a, "up"_a, nb::kw_only(),
        "stream"_a = nb::none(),
        "gelu_approx(gate) * up (mlx-lm's Gemma 3 MLP), one op.");
  m.def("clip_add", &kvchat::clip_add, "x"_a, "y"_a, nb::kw_only(), "stream"_a = nb::none(),
        "clip(x + y) to float16's range, summed in float32 (Gemma 3's residual), one op.");
  m.def("kv_write", &kvchat::kv_write, "pool"_a, "slots"_a, "rows"_a, nb::kw_only(),
        "stream"_a = nb::none(),
        "pool (H, S, D) with rows (H, N, D) written at slots (N,): one op, in place when\n"
        "the pool is donated.");
  m.def("channel_quant", &kvchat::channel_quant, "res"_a, "at"_a, nb::kw_only(),
        "block_size"_a, "bits"_a, "signs"_a = nb::none(), "stream"_a = nb::none(),
        "Per-channel key quantization of filled residual blocks -> [codes, scales, biases].");
  m.def(
      "layer_head",
      [](const mx::array& h, const mx::array& norm, const std::vector<mx::array>& qkv,
         const mx::array& offsets, float eps, const std::vector<kvchat::Spec>& specs,
         int heads, int kv_heads, int dims, bool traditional, float base, float scale,
         const std::optional<mx::array>& freqs) {
        std::vector<kvchat::LinearSpec> parts;
        for (const auto& sp : specs) parts.push_back(kvchat::spec_of(sp));
        return kvchat::layer_head(h, norm, qkv, parts, offsets, eps, heads, kv_heads,
                                  {dims, traditional, base, scale}, freqs);
      },
      "h"_a, "norm"_a, "qkv"_a, "offsets"_a, nb::kw_only(), "eps"_a, "specs"_a, "heads"_a,
      "kv_heads"_a, "dims"_a, "traditional"_a, "base"_a, "scale"_a, "freqs"_a = nb::none(),
      "rms_norm, the q/k/v qmm (one fused (w, scales, biases), or q, k and v apart, a spec\n"
      "each) and qkv_rope of a layer as one op -> [q, k, v].");
  m.def(
      "layer_tail",
      [](const mx::array& h, const mx::array& att, const std::vector<mx::array>& o,
         const mx::array& norm, const std::vector<mx::array>& gate_up,
         const std::vector<mx::array>& down, float eps, const kvchat::Spec& o_spec,
         const kvchat::Spec& gate_up_spec, const kvchat::Spec& down_spec) {
        return kvchat::layer_tail(h, att, o, norm, gate_up, down, eps, kvchat::spec_of(o_spec),
                                  kvchat::spec_of(gate_up_spec), kvchat::spec_of(down_spec));
      },
      "h"_a, "att"_a, "o"_a, "norm"_a, "gate_up"_a, "down"_a, nb::kw_only(), "eps"_a,
      "o_spec"_a, "gate_up_spec"_a, "down_spec"_a,
      "h + o_proj(att), then its post-attention norm, gate/up qmm, swiglu, down qmm and\n"
      "residual: a layer's rest after attention as one op.");
  m.def(
      "gemma_tail",
      [](const mx::array& h, const mx::array& att, const std::vector<mx::array>& o,
         const std::vector<mx::array>& norms, const std::vector<mx::array>& gate,
         const std::vector<mx::array>& up, const std::vector<mx::array>& down, float eps,
         const std::vector<kvchat::Spec>& specs) {
        std::vector<kvchat::LinearSpec> parts;
        for (const auto& sp : specs) parts.push_back(kvchat::spec_of(sp));
        return kvchat::gemma_tail(h, att, o, norms, gate, up, down, eps, parts);
      },
      "h"_a, "att"_a, "o"_a, "norms"_a, "gate"_a, "up"_a, "down"_a, nb::kw_only(), "eps"_a,
      "specs"_a,
      "Gemma 3's layer after attention (o_proj, norms, float16 residual sums, the tanh\n"
      "GELU MLP) as one op; norms are the (1 + w) scales after o, before and after the MLP.");
  nb::class_<kvchat::LayerStack>(m, "LayerStack",
                                 "A step's extension layers built in C++ (layer_stack.h).")
      .def(nb::init<int, int, int>(), "heads"_a, "kv_heads"_a, "block_size"_a)
      .def(
          "add",
          [](kvchat::LayerStack& self, const mx::array& in_norm, float in_eps,
             const std::vector<mx::array>& qkv, const std::vector<kvchat::Spec>& qkv_specs,
             int dims, bool traditional, float base, float rope_scale,
             const std::optional<mx::array>& freqs, const std::vector<mx::array>& o,
             const kvchat::Spec& o_spec, const mx::array& post_norm, float post_eps,
             const std::vector<mx::array>& gate_up, const kvchat::Spec& gate_up_spec,
             const std::vector<mx::array>& down, const kvchat::Spec& down_spec, float scale) {
            std::vector<kvchat::LinearSpec> parts;
            for (const auto& sp : qkv_specs) parts.push_back(kvchat::spec_of(sp));
            if (o.size() != 3 || gate_up.size() != 3 || down.size() != 3 || parts.empty() ||
                qkv.size() != 3 * parts.size())
              throw std::invalid_argument("LayerStack.add: linears are (w, scales, biases)");
            self.add({in_norm, in_eps, qkv, parts, {dims, traditional, base, rope_scale}, freqs,
                      o, gate_up, down, kvchat::spec_of(o_spec), kvchat::spec_of(gate_up_spec),
                      kvchat::spec_of(down_spec), post_norm, post_eps, scale});
          },
          "in_norm"_a, "in_eps"_a, "qkv"_a, "qkv_specs"_a, "dims"_a, "traditional"_a, "base"_a,
          "rope_scale"_a, "freqs"_a.none(), "o"_a, "o_spec"_a, "post_norm"_a, "post_eps"_a,
          "gate_up"_a, "gate_up_spec"_a, "down"_a, "down_spec"_a, "scale"_a)
      .def("__len__", &kvchat::LayerStack::size)
      .def(
          "run",
          [](const kvchat::LayerStack& self, const mx::array& h,
             const kvchat::LayerStack::Sides& keys, const kvchat::LayerStack::Sides& values,
             const mx::array& slots, const mx::array& block_tables,
             const mx::array& context_lens, const mx::array& offsets, int first, int kind,
             int k_bits, int k_group, int v_bits, int v_group, bool rotate_k, bool rotate_v,
             const std::optional<mx::array>& rotation, const std::optional<mx::array>& res_map) {
            kvchat::StackKV kv{kind, k_bits, k_group, v_bits, v_group, rotate_k, rotate_v,
                               rotation, res_map};
            return self.run(h, keys, values, kv, slots, block_tables, context_lens, offsets,
                            first);
          },
          "h"_a, "keys"_a, "values"_a, "slots"_a, "block_tables"_a, "context_lens"_a,
          "offsets"_a, "first"_a, nb::kw_only(), "kind"_a = 0, "k_bits"_a = 0, "k_group"_a = 0,
          "v_bits"_a = 0, "v_group"_a = 0, "rotate_k"_a = false, "rotate_v"_a = false,
          "rotation"_a = nb::none(), "res_map"_a = nb::none(),
          "Layers first.. of h, each side's arrays per layer as `kind` stores them (0 float,\n"
          "1 quantized rows, 2 residual -kivi): (h, their keys, their values).");
  m.def("tile_rows", &kvchat::tile_rows, "w"_a, nb::kw_only(), "group_size"_a, "bits"_a,
        "stream"_a = nb::none(), "MLX-packed 4/8-bit w (rows in 16s) in the tiled layout.");
  m.def("switch_qmm", &kvchat::switch_qmm, "x"_a, "w"_a, "scales"_a, "biases"_a, "indices"_a,
        nb::kw_only(), "group_size"_a, "bits"_a, "stream"_a = nb::none(),
        "MoE experts: row p of x (or p / k) times expert indices[p]'s tiled weights, (P, N).");
  m.def("kv_write_quant", &kvchat::kv_write_quant, "pool"_a, "slots"_a, "rows"_a,
        "rotation"_a = nb::none(), nb::kw_only(), "part"_a, "bits"_a, "group"_a,
        "stream"_a = nb::none(),
        "One part (0 packed rows, 1 scales, 2 biases) of a quantized pool (H, S, W) with rows\n"
        "(H, N, D) (rotated by `rotation` first) quantized and written at slots (N,): one op.");
  m.def(
      "kv_write_sides",
      [](const std::vector<mx::array>& keys, const std::vector<mx::array>& values,
         const mx::array& slots, const mx::array& k_rows, const mx::array& v_rows,
         const std::optional<mx::array>& rotation, int k_bits, int k_group, bool rotate_k,
         int v_bits, int v_group, bool rotate_v, mx::StreamOrDevice s) {
        return kvchat::kv_write_sides(keys, values, slots, k_rows, v_rows, rotation,
                                      {k_bits, k_group, rotate_k}, {v_bits, v_group, rotate_v},
                                      s);
      },
      "keys"_a, "values"_a, "slots"_a, "k_rows"_a, "v_rows"_a, "rotation"_a = nb::none(),
      nb::kw_only(), "k_bits"_a = 0, "k_group"_a = 0, "rotate_k"_a = false, "v_bits"_a = 0,
      "v_group"_a = 0, "rotate_v"_a = false, "stream"_a = nb::none(),
      "A layer's K and V stores (each [pool] float, or [packed rows, scales, biases]) with\n"
      "rows (H, N, D) written at slots (N,): one op for both sides, each array in place\n"
      "when nothing else holds it -> the keys' arrays then the values'.");
  m.def("hadamard", &kvchat::hadamard, "x"_a, "signs"_a, nb::kw_only(), "inverse"_a = false,
        "stream"_a = nb::none(),
        "x (..., D) times kvchat's K/V rotation R (inverse: R^T), given R's (D,) signs: one op.");
  m.def("greedy_pick", &kvchat::greedy_pick, "logits"_a, nb::kw_only(), "stream"_a = nb::none(),
        "Each row's greedy token where it provably equals argmax(logits - logsumexp(logits)),\n"
        "else -1.");
  m.def("tiled_rows8", &kvchat::tiled_rows8, "w"_a, "scales"_a, "biases"_a, "rows"_a,
        "group_size"_a, nb::kw_only(), "stream"_a = nb::none(),
        "Rows of a tiled 8-bit embedding (int32 ids, any shape) dequantized as\n"
        "mx.dequantize gives them: one op.");
  m.def("simd", &kvchat::build_info, "The SIMD path compiled in.");
  m.def("threads", [] { return kvchat::ThreadPool::instance().size(); },
        "Threads the kernels use (KVCHAT_CPU_THREADS).");
}
