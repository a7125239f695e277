// kvchat's K/V rotation R (`kvcache.rotation`) applied to rows as one primitive: the
// signs, then a fast Walsh-Hadamard transform of each power-of-two block (O(D log D)
// per row), where MLX's route is a cast, a GEMM by the (D, D) matrix and reshapes
// (~5 nodes, run twice a layer when queries and outputs of a rotated pool are rotated).
#include <cmath>
#include <stdexcept>

#include "kernels.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "simd.h"
#include "tensor.h"

namespace kvchat {

namespace {

// One butterfly stage between lanes `len` apart inside each vector: lane i takes
// x[i ^ len] + x[i] where i's bit `len` is clear, x[i ^ len] - x[i] where it is set.
template <int len>
inline vf lane_stage(vf x) {
  vf sign;
  for (int i = 0; i < W; ++i) sign[i] = (i & len) ? -1.0f : 1.0f;
  vf partner;
  if constexpr (len == 1)
    partner = __builtin_shufflevector(x, x, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  else if constexpr (len == 2)
    partner = __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  else if constexpr (len == 4)
    partner = __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  else
    partner = __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  return partner + sign * x;
}

// The butterflies of each block of n elements of y (count in all): floats, or vectors for
// the stages between vectors.
template <class T>
void butterflies(T* y, int count, int n) {
  for (int b0 = 0; b0 < count; b0 += n)
    for (int len = 1; len < n; len <<= 1)
      for (int i = b0; i < b0 + n; i += 2 * len)
        for (int j = i; j < i + len; ++j) {
          const T a = y[j], b = y[j + len];
          y[j] = a + b;
          y[j + len] = a - b;
        }
}

}  // namespace

void hadamard_row(const float* x, float* y, int D, const float* signs, bool inverse) {
  const int n = D & -D;
  const float norm = 1.0f / std::sqrt(float(n));
  if (n % W != 0 || D > 256) {  // blocks narrower than a vector (or rows past 256): scalar
    for (int c = 0; c < D; ++c) y[c] = inverse ? x[c] : x[c] * signs[c];
    butterflies(y, D, n);
    for (int c = 0; c < D; ++c) y[c] *= inverse ? norm * signs[c] : norm;
    return;
  }
  // The same butterflies with vectors: the stages inside a vector by lane shuffles, those
  // between vectors by adds (same sums in the same order as the scalar loop, so equal bits).
  vf v[256 / W];
  const int nv = D / W, bv = n / W;
  for (int j = 0; j < nv; ++j) {
    v[j] = load(x + j * W);
    if (!inverse) v[j] *= load(signs + j * W);
    v[j] = lane_stage<8>(lane_stage<4>(lane_stage<2>(lane_stage<1>(v[j]))));
  }
  butterflies(v, nv, bv);
  for (int j = 0; j < nv; ++j) {
    vf out = v[j] * splat(norm);
    if (inverse) out *= load(signs + j * W);
    store(y + j * W, out);
  }
}

namespace {

class Hadamard : public mx::UnaryPrimitive {
 public:
  Hadamard(mx::Stream stream, bool inverse) : mx::UnaryPrimitive(stream), inverse_(inverse) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (auto& a : inputs) encoder.set_input_array(a);
    encoder.set_output_array(out);
    encoder.dispatch([x = inputs[0], signs = inputs[1], out, inverse = inverse_]() mutable {
      guarded(out, [&] {
        std::vector<float> x_buf, s_buf;
        const float* xf = rows_as_float(x, x_buf);
        const float* s = rows_as_float(signs, s_buf);
        const int D = x.shape(-1);
        const int64_t rows = int64_t(x.size()) / D;
        std::vector<float> y(size_t(rows) * D);
        for (int64_t r = 0; r < rows; ++r) hadamard_row(xf + r * D, y.data() + r * D, D, s, inverse);
        store_any(out.data<char>(), elem_of(out.dtype()), y.data(), int64_t(y.size()));
      });
    });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("KvchatHadamard runs on the CPU only");
  }
  const char* name() const override {
    return "KvchatHadamard";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    return inverse_ == static_cast<const Hadamard&>(other).inverse_;
  }

 private:
  bool inverse_;
};

}  // namespace

mx::array hadamard(const mx::array& x, const mx::array& signs, bool inverse,
                   mx::StreamOrDevice s) {
  if (x.ndim() < 1 || !is_float_dtype(x.dtype()))
    throw std::invalid_argument("hadamard: x must be a float array");
  const int D = x.shape(-1);
  if ((D & -D) < 2 || signs.ndim() != 1 || signs.shape(0) != D || signs.dtype() != mx::float32)
    throw std::invalid_argument("hadamard: signs must be float32 (D,) for an even D");
  auto stream = mx::to_stream(s, mx::Device::cpu);
  return mx::array(x.shape(), x.dtype(), std::make_shared<Hadamard>(stream, inverse),
                   {x, signs});
}

}  // namespace kvchat
