// RMSNorm and RoPE as single primitives. On the CPU backend MLX builds both
// from their fallbacks: ~11 ops per norm and ~34 per rotary embedding, which at
// ~5 us of dispatch each were over half of a decode step's graph.
#include <cmath>
#include <stdexcept>
#include <string>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "kernels.h"
#include "norm_rope.h"
#include "tensor.h"

namespace kvchat {

namespace {

void rope_rows(const mx::array& x, const mx::array& offsets, const mx::array* freqs,
               mx::array& out, const RopeParams& p) {
  std::vector<char> x_buf, o_buf;
  const char* xs = static_cast<const char*>(row_major(x, x_buf));
  const int32_t* offs = static_cast<const int32_t*>(row_major(offsets, o_buf));
  const int B = x.shape(0), H = x.shape(1), L = x.shape(2), D = x.shape(3);
  const Elem e = elem_of(x.dtype());
  const size_t item = x.itemsize();
  std::vector<float> f_buf;
  const std::vector<float> inv_freq = rope_inv_freq(p, freqs_of(freqs, f_buf));
  std::vector<float> row(D), cs(inv_freq.size() * 2);
  for (int b = 0; b < B; ++b) {
    const int32_t off = offsets.size() == 1 ? offs[0] : offs[b];
    for (int l = 0; l < L; ++l) {
      rope_angles(p, inv_freq, float(l) + float(off), cs.data());
      for (int h = 0; h < H; ++h) {
        const int64_t at = ((int64_t(b) * H + h) * L + l) * D;
        for (int d = 0; d < D; ++d) row[d] = scalar_any(xs, e, at + d);
        rope_rotate(p, cs.data(), row.data());
        store_any(out.data<char>() + at * item, e, row.data(), D);
      }
    }
  }
}

}  // namespace

void rms_norm_into(const mx::array& x, const mx::array& w, mx::array& out, float eps) {
  std::vector<float> x_buf, w_buf;
  const float* xf = rows_as_float(x, x_buf);
  const float* wf = rows_as_float(w, w_buf);
  const int D = x.shape(-1);
  const int64_t rows = int64_t(x.size()) / D;
  const Elem oe = elem_of(out.dtype());
  std::vector<float> y(D);
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = xf + r * D;
    vf acc = vf{};
    int d = 0;
    for (; d + W <= D; d += W) {
      const vf v = load(xr + d);
      acc += v * v;
    }
    float ss = hsum(acc);
    for (; d < D; ++d) ss += xr[d] * xr[d];
    const float inv = 1.0f / std::sqrt(ss / float(D) + eps);
    for (d = 0; d < D; ++d) y[d] = xr[d] * inv * wf[d];
    store_any(out.data<char>() + r * D * out.itemsize(), oe, y.data(), D);
  }
}

void RmsNorm::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (auto& a : inputs) encoder.set_input_array(a);
  encoder.set_output_array(out);
  encoder.dispatch([x = inputs[0], w = inputs[1], out, eps = eps_]() mutable {
    guarded(out, [&] { rms_norm_into(x, w, out, eps); });
  });
}

void RmsNorm::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("KvchatRmsNorm runs on the CPU only");
}

bool RmsNorm::is_equivalent(const mx::Primitive& other) const {
  return eps_ == static_cast<const RmsNorm&>(other).eps_;
}

void Rope::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (auto& a : inputs) encoder.set_input_array(a);
  encoder.set_output_array(out);
  encoder.dispatch([in = inputs, out, p = params_]() mutable {
    guarded(out, [&] { rope_rows(in[0], in[1], in.size() > 2 ? &in[2] : nullptr, out, p); });
  });
}

void Rope::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("KvchatRope runs on the CPU only");
}

bool Rope::is_equivalent(const mx::Primitive& other) const {
  const RopeParams& o = static_cast<const Rope&>(other).params_;
  return params_.dims == o.dims && params_.traditional == o.traditional &&
         params_.base == o.base && params_.scale == o.scale;
}

mx::array rms_norm(const mx::array& x, const mx::array& weight, float eps,
                   mx::StreamOrDevice s) {
  if (x.ndim() < 1 || weight.ndim() != 1 || weight.shape(0) != x.shape(-1) ||
      !is_float_dtype(x.dtype()) || !is_float_dtype(weight.dtype()))
    throw std::invalid_argument("rms_norm: x (..., D) and weight (D,) must be float arrays");
  auto stream = mx::to_stream(s, mx::Device::cpu);
  return mx::array(x.shape(), mx::promote_types(x.dtype(), weight.dtype()),
                   std::make_shared<RmsNorm>(stream, eps), {x, weight});
}

const float* freqs_of(const mx::array* freqs, std::vector<float>& buf) {
  return freqs ? rows_as_float(*freqs, buf) : nullptr;
}

void check_freqs(const std::optional<mx::array>& freqs, int dims, const char* op) {
  if (freqs && (freqs->dtype() != mx::float32 || freqs->ndim() != 1 ||
                freqs->shape(0) != dims / 2))
    throw std::invalid_argument(std::string(op) + ": freqs must be float32 (dims / 2,)");
}

mx::array rope(const mx::array& x, const mx::array& offsets, int dims, bool traditional,
               float base, float scale, const std::optional<mx::array>& freqs,
               mx::StreamOrDevice s) {
  if (x.ndim() != 4 || !is_float_dtype(x.dtype()))
    throw std::invalid_argument("rope: x must be a float (B, H, L, D) array");
  if (dims <= 0 || dims % 2 != 0 || dims > x.shape(3))
    throw std::invalid_argument("rope: dims must be even, positive and <= D");
  if (offsets.dtype() != mx::int32 || offsets.ndim() > 1 ||
      (offsets.size() != 1 && int(offsets.size()) != x.shape(0)))
    throw std::invalid_argument("rope: offset must be int32, a scalar or one per batch row");
  check_freqs(freqs, dims, "rope");
  auto stream = mx::to_stream(s, mx::Device::cpu);
  std::vector<mx::array> inputs{x, offsets};
  if (freqs) inputs.push_back(*freqs);
  return mx::array(x.shape(), x.dtype(),
                   std::make_shared<Rope>(stream, RopeParams{dims, traditional, base, scale}),
                   inputs);
}

}  // namespace kvchat
