// Writing new K or V rows into a quantized pool: one node per stored part.
//
// A quantized side is three arrays (packed rows, scales, biases). Through MLX the
// write was the rotation, `mx.quantize`, casts and three scatters of ~12 nodes each:
// ~45 nodes per side and layer, which made decode on a quantized pool half as fast as
// on a float16 one although attention reads a half or a quarter of the bytes. Here
// each part is one `kv_write`-like node (in place when donated) that rotates (a fast
// Walsh-Hadamard transform: the same R as `kvcache.rotation`, O(D log D)) and quantizes
// the new rows itself; the three recompute the same rows, a few hundred operations
// each, so that each can own its pool array. (One node with three outputs cannot write in
// place: MLX counts each sibling output's reference to the inputs, so `is_donatable` is
// false and every write copied the whole pool, measured 28 ms a write.)
//
// The quantization is MLX's affine `quantize` step for step (min/max per group, the
// scale's sign and edge rule, rint, clamp), scales and biases rounded to the rows'
// dtype and then to float16, as `kv_cache._quantize` stores them.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>

#include "kernels.h"
#include "kv_write_parts.h"
#include "kv_write_quant.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "tensor.h"

namespace kvchat {

namespace {

// v rounded to the dtype `e` and read back (MLX rounds the rotated rows, and the scales and
// biases, to the rows' dtype before they go on); a no-op for float32.
void round_through(Elem e, float* v, int n) {
  if (e == Elem::f32) return;
  uint16_t h[W];
  for (int i = 0; i < n; i += W) {
    const int m = std::min(W, n - i);
    store_any(h, e, v + i, m);
    for (int j = 0; j < m; ++j) v[i + j] = scalar_any(h, e, j);
  }
}

// One row (D floats) quantized: packed words, and per group scale and bias (float, already
// rounded through the rows' dtype `e`).
void quantize_row(const float* x, int D, int bits, int group, Elem e, uint32_t* words,
                  float* scales, float* biases) {
  const float n_bins = float((1 << bits) - 1), eps = 1e-7f;
  const int per_word = 32 / bits;
  for (int g = 0; g < D / group; ++g) {
    const float* w = x + g * group;
    float w_min = INFINITY, w_max = -INFINITY;
    for (int j = 0; j < group; ++j) {
      w_max = std::max(w_max, w[j]);
      w_min = std::min(w_min, w[j]);
    }
    const bool mask = std::abs(w_min) > std::abs(w_max);
    float scale = std::max((w_max - w_min) / n_bins, eps);
    scale = mask ? scale : -scale;
    const float edge = mask ? w_min : w_max;
    const float q0 = std::rint(edge / scale);
    float bias = 0;
    if (q0 != 0) {
      scale = edge / q0;
      bias = edge;
    }
    for (int j = 0; j < group / per_word; ++j) {
      uint32_t word = 0;
      for (int k = 0; k < per_word; ++k) {
        float q = std::rint((w[j * per_word + k] - bias) / scale);
        q = std::min(std::max(q, 0.0f), n_bins);
        word |= uint32_t(q) << (k * bits);
      }
      words[(g * group) / per_word + j] = word;
    }
    float sb[2] = {scale, bias};
    round_through(e, sb, 2);  // MLX's quantize stores them in the rows' dtype first
    scales[g] = sb[0];
    biases[g] = sb[1];
  }
}

}  // namespace

void write_quant_parts(const mx::array* pools, const mx::array& slots, const mx::array& rows,
                       const mx::array* rotation, mx::array* const* outs, const bool* donated,
                       const QuantWrite& q) {
  // rotation: the (D,) signs of kvchat's rotation; its Hadamard blocks are D's largest
  // power-of-two divisor wide (`quant.rotation_block`)
  const int64_t N = rows.shape(1);
  const int D = rows.shape(2), G = D / q.group;
  int64_t H = 0, S = 0;
  char* dst[3] = {nullptr, nullptr, nullptr};
  int64_t width[3] = {0, 0, 0}, item[3] = {0, 0, 0};
  std::vector<char> pool_buf;
  for (int i = 0; i < 3; ++i) {
    if (outs[i] == nullptr) continue;
    const mx::array& pool = pools[i];
    H = pool.shape(0);
    S = pool.shape(1);
    width[i] = pool.shape(2);
    item[i] = outs[i]->itemsize();
    dst[i] = outs[i]->data<char>();
    if (!donated[i]) std::memcpy(dst[i], row_major(pool, pool_buf), outs[i]->nbytes());
  }
  std::vector<char> slot_buf;
  std::vector<float> r_buf, m_buf, rot(D), scales(G), biases(G);
  const float* rf = rows_as_float(rows, r_buf);
  const float* signs = rotation ? rows_as_float(*rotation, m_buf) : nullptr;
  const int32_t* s = static_cast<const int32_t*>(row_major(slots, slot_buf));
  const Elem re = elem_of(rows.dtype());
  std::vector<uint32_t> words(D * q.bits / 32);
  for (int64_t h = 0; h < H; ++h)
    for (int64_t i = 0; i < N; ++i) {
      if (s[i] < 0 || s[i] >= S) continue;  // never outside the pool
      const float* x = rf + (h * N + i) * D;
      if (signs) {  // x R, by a fast Walsh-Hadamard transform
        hadamard_row(x, rot.data(), D, signs, false);
        round_through(re, rot.data(), D);  // as `rotation.rotate` returns the rows' dtype
        x = rot.data();
      }
      quantize_row(x, D, q.bits, q.group, re, words.data(), scales.data(), biases.data());
      const int64_t at = h * S + s[i];
      if (dst[0]) std::memcpy(dst[0] + at * width[0] * item[0], words.data(),
                              words.size() * sizeof(uint32_t));
      if (dst[1]) store_any(dst[1] + at * width[1] * item[1], elem_of(outs[1]->dtype()),
                            scales.data(), G);
      if (dst[2]) store_any(dst[2] + at * width[2] * item[2], elem_of(outs[2]->dtype()),
                            biases.data(), G);
    }
}

void KvWriteQuant::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  const mx::array& pool = inputs[0];
  const bool donated = share_if_donated(pool, out);
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (auto& a : inputs) encoder.set_input_array(a);
  encoder.set_output_array(out);
  encoder.dispatch([in = inputs, out, donated, q = q_]() mutable {
    try {
      mx::array* outs[3] = {nullptr, nullptr, nullptr};
      outs[q.part] = &out;
      bool don[3] = {false, false, false};
      don[q.part] = donated;
      const mx::array pools[3] = {in[0], in[0], in[0]};
      write_quant_parts(pools, in[1], in[2], in.size() > 3 ? &in[3] : nullptr, outs, don, q);
    } catch (...) {  // an exception must not leave a dispatched task; the rows stay unwritten
    }
  });
}

void KvWriteQuant::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("KvchatKvWriteQuant runs on the CPU only");
}

void check_quant_part(const mx::array& pool, const mx::array& slots, const mx::array& rows,
                      const std::optional<mx::array>& rotation, int part, int bits, int group) {
  if (bits != 4 && bits != 8) throw std::invalid_argument("kv_write_quant: bits must be 4 or 8");
  if (part < 0 || part > 2) throw std::invalid_argument("kv_write_quant: part is 0, 1 or 2");
  if (rows.ndim() != 3 || pool.ndim() != 3 || slots.ndim() != 1 || slots.dtype() != mx::int32 ||
      !is_float_dtype(rows.dtype()) || rows.shape(0) != pool.shape(0) ||
      rows.shape(1) != slots.shape(0))
    throw std::invalid_argument("kv_write_quant: pool (H, S, W), rows (H, N, D), slots (N,)");
  const int D = rows.shape(2);
  if (group <= 0 || D % group != 0 || group % (32 / bits) != 0)
    throw std::invalid_argument("kv_write_quant: the group must divide D into whole words");
  const int width = part == 0 ? D * bits / 32 : D / group;
  if (pool.shape(2) != width || (part == 0) != (pool.dtype() == mx::uint32) ||
      (part != 0 && !is_float_dtype(pool.dtype())))
    throw std::invalid_argument("kv_write_quant: the pool part does not fit the rows");
  if (rotation && (rotation->ndim() != 1 || rotation->shape(0) != D ||
                   rotation->dtype() != mx::float32))
    throw std::invalid_argument("kv_write_quant: rotation must be D float32 signs");
}

mx::array kv_write_quant(const mx::array& pool, const mx::array& slots, const mx::array& rows,
                         const std::optional<mx::array>& rotation, int part, int bits, int group,
                         mx::StreamOrDevice s) {
  check_quant_part(pool, slots, rows, rotation, part, bits, group);
  auto stream = mx::to_stream(s, mx::Device::cpu);
  std::vector<mx::array> inputs{pool, slots, rows};
  if (rotation) inputs.push_back(*rotation);
  return mx::array(pool.shape(), pool.dtype(),
                   std::make_shared<KvWriteQuant>(stream, QuantWrite{part, bits, group}),
                   inputs);
}

}  // namespace kvchat
