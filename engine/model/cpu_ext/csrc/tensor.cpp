#include "tensor.h"

#include <algorithm>
#include <cstring>
#include <limits>

#include "mlx/allocator.h"

namespace kvchat {

namespace {

// Copy the elements of an arbitrarily strided array into row-major order.
void strided_copy(const char* src, char* dst, const mx::Shape& shape, const mx::Strides& strides,
                  size_t itemsize) {
  const int nd = int(shape.size());
  int64_t total = 1;
  for (int d = 0; d < nd; ++d) total *= shape[d];
  if (total == 0) return;
  if (nd == 0) {
    std::memcpy(dst, src, itemsize);
    return;
  }
  std::vector<int64_t> idx(nd, 0);
  const int64_t inner = shape[nd - 1];
  const int64_t inner_stride = strides[nd - 1];
  for (int64_t done = 0; done < total; done += inner) {
    int64_t offset = 0;
    for (int d = 0; d < nd - 1; ++d) offset += idx[d] * strides[d];
    const char* row = src + offset * int64_t(itemsize);
    if (inner_stride == 1) {
      std::memcpy(dst, row, inner * itemsize);
    } else {
      for (int64_t i = 0; i < inner; ++i)
        std::memcpy(dst + i * itemsize, row + i * inner_stride * int64_t(itemsize), itemsize);
    }
    dst += inner * itemsize;
    for (int d = nd - 2; d >= 0; --d) {
      if (++idx[d] < shape[d]) break;
      idx[d] = 0;
    }
  }
}

}  // namespace

const void* row_major(const mx::array& a, std::vector<char>& scratch) {
  if (a.flags().row_contiguous) return a.data<char>();
  scratch.resize(a.size() * a.itemsize());
  strided_copy(a.data<char>(), scratch.data(), a.shape(), a.strides(), a.itemsize());
  return scratch.data();
}

const float* rows_as_float(const mx::array& a, std::vector<float>& scratch) {
  if (a.dtype() == mx::float32 && a.flags().row_contiguous) return a.data<float>();
  std::vector<char> raw;
  const void* src = row_major(a, raw);
  const Elem e = elem_of(a.dtype());
  const int64_t n = int64_t(a.size());
  scratch.resize(n);
  int64_t i = 0;
  for (; i + W <= n; i += W) store(scratch.data() + i, load_any(src, e, i));
  for (; i < n; ++i) scratch[i] = scalar_any(src, e, i);
  return scratch.data();
}

namespace {

// MLX's `array::is_donatable` for an input of a primitive with `outputs` outputs: its only
// holders are those outputs' input lists, and no other array shares its buffer.
bool sole_input(const mx::array& a, size_t outputs) {
  if (outputs == 1) return a.is_donatable();
  // mx::array is one shared_ptr to its description; MLX exposes no count of its holders
  static_assert(sizeof(mx::array) == sizeof(std::shared_ptr<void>), "mx::array layout");
  const auto& desc = *reinterpret_cast<const std::shared_ptr<void>*>(&a);
  const auto& data = a.data_shared_ptr();
  return size_t(desc.use_count()) == outputs && data && data.use_count() == 1 &&
         data->is_owned();
}

}  // namespace

bool share_if_donated(const mx::array& pool, mx::array& out, size_t outputs) {
  const bool donated = pool.flags().row_contiguous && sole_input(pool, outputs);
  if (donated)
    out.copy_shared_buffer(pool);
  else
    out.set_data(mx::allocator::malloc(out.nbytes()));
  return donated;
}

mx::array shared_view(const mx::array& base, mx::Shape shape, int64_t offset) {
  mx::Strides strides(shape.size(), 1);
  for (int i = int(shape.size()) - 2; i >= 0; --i) strides[i] = strides[i + 1] * shape[i + 1];
  mx::array view(std::move(shape), base.dtype(), nullptr, {});
  mx::array::Flags flags{};
  flags.contiguous = flags.row_contiguous = true;
  flags.col_contiguous = view.ndim() <= 1 || view.size() <= 1;
  view.copy_shared_buffer(base, strides, flags, view.size(), offset);
  return view;
}

void fill_nan(mx::array& out) {
  const int64_t n = int64_t(out.size());
  if (out.dtype() == mx::float32) {
    std::fill(out.data<float>(), out.data<float>() + n, std::numeric_limits<float>::quiet_NaN());
  } else {
    const uint16_t bits = out.dtype() == mx::float16 ? 0x7e00 : 0x7fc0;
    std::fill(out.data<uint16_t>(), out.data<uint16_t>() + n, bits);
  }
}

namespace {

uint16_t float_to_half_bits(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000;
  const uint32_t absx = x & 0x7fffffff;
  if (absx >= 0x7f800000) return uint16_t(sign | 0x7c00 | (absx > 0x7f800000 ? 0x200 : 0));
  if (absx >= 0x477ff000) return uint16_t(sign | 0x7c00);  // rounds to inf
  if (absx < 0x38800000) {  // subnormal half or zero
    if (absx < 0x33000000) return uint16_t(sign);
    const uint32_t mant = (absx & 0x7fffff) | 0x800000;
    const int shift = 113 - int(absx >> 23) + 13;
    uint32_t h = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (h & 1))) ++h;
    return uint16_t(sign | h);
  }
  uint32_t h = ((absx - 0x38000000) >> 13);
  const uint32_t rem = absx & 0x1fff;
  if (rem > 0x1000 || (rem == 0x1000 && (h & 1))) ++h;
  return uint16_t(sign | h);
}

uint16_t float_to_bf16_bits(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if ((x & 0x7fffffff) > 0x7f800000) return uint16_t((x >> 16) | 0x40);  // quiet nan
  x += 0x7fff + ((x >> 16) & 1);
  return uint16_t(x >> 16);
}

}  // namespace

void store_any(void* dst, Elem e, const float* src, int64_t n) {
  if (e == Elem::f32) {
    std::memcpy(dst, src, n * sizeof(float));
    return;
  }
  uint16_t* out = static_cast<uint16_t*>(dst);
  int64_t i = 0;
  if (e == Elem::f16) {
#if defined(__F16C__)
    for (; i + 8 <= n; i += 8)
      _mm_storeu_si128((__m128i*)(out + i),
                       _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; i < n; ++i) out[i] = float_to_half_bits(src[i]);
  } else {
    for (; i < n; ++i) out[i] = float_to_bf16_bits(src[i]);
  }
}

}  // namespace kvchat
