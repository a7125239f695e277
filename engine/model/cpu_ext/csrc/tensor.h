// Reading MLX arrays from inside a dispatched CPU task: element types and
// row-contiguous access (a strided or broadcast input is copied once).
#pragma once

#include <cstdint>
#include <stdexcept>
#include <vector>

#include "mlx/array.h"
#include "simd.h"

namespace kvchat {

namespace mx = mlx::core;

inline Elem elem_of(mx::Dtype t) {
  if (t == mx::float32) return Elem::f32;
  if (t == mx::float16) return Elem::f16;
  if (t == mx::bfloat16) return Elem::bf16;
  throw std::invalid_argument("expected a float32, float16 or bfloat16 array");
}

inline bool is_float_dtype(mx::Dtype t) {
  return t == mx::float32 || t == mx::float16 || t == mx::bfloat16;
}

// Pointer to `a`'s elements in row-major order: the array itself when it is
// row-contiguous, else a copy in `scratch`.
const void* row_major(const mx::array& a, std::vector<char>& scratch);

// Give `out` (a pool's updated copy) the pool's own buffer when the pool can be
// updated in place (row-contiguous, donated: its caller holds no other reference),
// else a new one; returns whether it is the pool's (the caller copies the pool if not).
// `outputs`: of the primitive whose input `pool` is. MLX never donates a multi-output
// primitive's inputs (each output keeps its own copy of the input list, so
// `is_donatable`'s count is never 1); its rule is applied counting those copies.
bool share_if_donated(const mx::array& pool, mx::array& out, size_t outputs = 1);

// A row-major array of `shape` over `base`'s buffer from element `offset` on, no copy:
// a stacked array's slice, or the first rows of a buffer.
mx::array shared_view(const mx::array& base, mx::Shape shape, int64_t offset = 0);

// Fill `out` (a float array) with NaN: what a task that cannot compute reports.
void fill_nan(mx::array& out);

// Run `body`, turning any exception into a NaN output: an exception must not
// leave a task dispatched to MLX's CPU stream (it would abort the process).
template <class F>
void guarded(mx::array& out, F&& body) {
  try {
    body();
  } catch (...) {
    fill_nan(out);
  }
}

// Rows of `a` (last axis contiguous, K wide) as float32; `scratch` holds a
// converted copy unless `a` already is row-contiguous float32.
const float* rows_as_float(const mx::array& a, std::vector<float>& scratch);

}  // namespace kvchat
