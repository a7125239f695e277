// Writing new K or V rows into one layer's pool as one primitive.
//
// `pool[:, slots] = rows` through MLX indexing builds about a dozen nodes (an
// arange, broadcasts, index casts, reshapes, the scatter) per side and layer:
// ~700 of a decode step's ~1,400 nodes at ~5 us of dispatch each. This is one
// node. Like MLX's scatter, it updates the pool's buffer in place when the pool
// is donated (the caller holds no other reference), else it copies it first.
// Rows are converted to the pool's dtype with round-to-nearest-even, as astype; a pool
// of another dtype (quantized codes) takes rows of its own dtype, copied as they are.
#include <cstring>
#include <stdexcept>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "kv_write_parts.h"
#include "ops.h"
#include "tensor.h"

namespace kvchat {

void write_float_rows(const mx::array& pool, const mx::array& slots, const mx::array& rows,
                      mx::array& out, bool donated) {
  // a row: every element after the first two axes (a block of per-channel codes, say)
  const int64_t H = pool.shape(0), S = pool.shape(1), N = rows.shape(1);
  const int64_t D = int64_t(pool.size()) / (H * S);
  const size_t isz = pool.itemsize();
  char* dst = out.data<char>();
  std::vector<char> pool_buf;
  if (!donated) std::memcpy(dst, row_major(pool, pool_buf), out.nbytes());
  std::vector<char> raw;
  const char* src;
  if (rows.dtype() == pool.dtype()) {
    src = static_cast<const char*>(row_major(rows, raw));
  } else {
    std::vector<float> f;
    const float* rf = rows_as_float(rows, f);
    raw.resize(rows.size() * isz);
    if (pool.dtype() == mx::float32)
      std::memcpy(raw.data(), rf, raw.size());
    else
      store_any(raw.data(), elem_of(pool.dtype()), rf, int64_t(rows.size()));
    src = raw.data();
  }
  std::vector<char> slot_buf;
  const int32_t* s = static_cast<const int32_t*>(row_major(slots, slot_buf));
  const size_t row = size_t(D) * isz;
  for (int64_t h = 0; h < H; ++h)
    for (int64_t i = 0; i < N; ++i)
      if (s[i] >= 0 && s[i] < S)  // never outside the pool; the engine checks its slots
        std::memcpy(dst + (h * S + s[i]) * row, src + (h * N + i) * row, row);
}

void KvWrite::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  const mx::array& pool = inputs[0];
  const bool donated = share_if_donated(pool, out);
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (auto& a : inputs) encoder.set_input_array(a);
  encoder.set_output_array(out);
  encoder.dispatch([pool, slots = inputs[1], rows = inputs[2], out, donated]() mutable {
    write_float_rows(pool, slots, rows, out, donated);
  });
}

void KvWrite::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("KvchatKvWrite runs on the CPU only");
}

void check_float_write(const mx::array& pool, const mx::array& slots, const mx::array& rows) {
  bool fits = pool.ndim() >= 3 && rows.ndim() == pool.ndim() && slots.ndim() == 1 &&
              rows.shape(0) == pool.shape(0) && rows.shape(1) == slots.shape(0);
  for (int i = 2; fits && i < pool.ndim(); ++i) fits = rows.shape(i) == pool.shape(i);
  if (!fits)
    throw std::invalid_argument("kv_write: rows must be (H, N, ...) for a pool (H, S, ...) "
                                "and slots (N,)");
  if (slots.dtype() != mx::int32) throw std::invalid_argument("kv_write: slots must be int32");
  const bool floats = is_float_dtype(pool.dtype()) && is_float_dtype(rows.dtype());
  if (rows.dtype() != pool.dtype() && !floats)
    throw std::invalid_argument("kv_write: rows must have the pool's dtype, or both be float");
}

mx::array kv_write(const mx::array& pool, const mx::array& slots, const mx::array& rows,
                   mx::StreamOrDevice s) {
  check_float_write(pool, slots, rows);
  auto stream = mx::to_stream(s, mx::Device::cpu);
  return mx::array(pool.shape(), pool.dtype(), std::make_shared<KvWrite>(stream),
                   {pool, slots, rows});
}

}  // namespace kvchat
