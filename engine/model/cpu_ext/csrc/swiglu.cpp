// SwiGLU, silu(gate) * up, as one primitive. MLX's CPU sigmoid takes ~30 ns
// per element here (25 ms for one 512-token chunk of the default model's MLP,
// more than its gate/up matmul), and without mx.compile on CPU mlx-lm's
// swiglu is three such ops; this is a vectorized exp over both threads. Gemma 3's
// gelu_approx(gate) * up is the same shape of op (libm's powf and tanhf, scalar, were
// ~15 % of a Gemma-3-1B-shaped prefill's samples), and so is its float16 residual sum
// (mlx-lm's clip_residual: two casts, an add, a clip and a cast, ~8 graph nodes).
#include <algorithm>
#include <stdexcept>
#include <string>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "kernels.h"
#include "norm_rope.h"
#include "pool.h"
#include "tensor.h"

namespace kvchat {

namespace {

constexpr int64_t kChunk = 1 << 14;  // elements per task (whole rows)

// silu(g) = g * sigmoid(g), with sigmoid from exp(-|g|) <= 1 (no overflow).
inline vf silu(vf g) {
  const vf e = exp_neg(g < 0 ? g : -g);
  const vf s = 1.0f / (1.0f + e);
  return g * (g < 0 ? e * s : s);
}

// mlx's gelu_approx, 0.5 g (1 + tanh(z)) with z = sqrt(2 / pi) (g + 0.044715 g^3), as
// g * sigmoid(2 z) (the same function), the sigmoid from exp(-|2z|) <= 1 as in silu.
inline vf gelu_tanh(vf g) {
  const vf a = 2.0f * 0.7978845608028654f * (g + 0.044715f * g * g * g);
  const vf e = exp_neg(a < 0 ? a : -a);
  const vf s = 1.0f / (1.0f + e);
  return g * (a < 0 ? e * s : s);
}

inline vf silu_mul(vf g, vf u) { return silu(g) * u; }
inline vf gelu_mul(vf g, vf u) { return gelu_tanh(g) * u; }

// clip(g + u, -65504, 65504) as clip_residual computes it in float32 (NaN stays NaN).
inline vf clip_add(vf g, vf u) {
  const vf x = g + u, hi = splat(65504.0f), lo = splat(-65504.0f);
  const vf y = x > hi ? hi : x;
  return y < lo ? lo : y;
}

template <vf (*Op)(vf, vf)>
void gated_rows(const float* g, int64_t ldg, const float* u, int64_t ldu, int64_t rows,
                int64_t D, float* y) {
  const int64_t rows_per_task = std::max<int64_t>(1, kChunk / std::max<int64_t>(D, 1));
  ThreadPool::instance().run(int((rows + rows_per_task - 1) / rows_per_task), [&](int t) {
    for (int64_t r = t * rows_per_task; r < std::min(rows, (t + 1) * rows_per_task); ++r) {
      const float *gr = g + r * ldg, *ur = u + r * ldu;
      float* yr = y + r * D;
      int64_t i = 0;
      for (; i + W <= D; i += W) store(yr + i, Op(load(gr + i), load(ur + i)));
      for (; i < D; ++i) {
        float g_lane[W] = {gr[i]}, u_lane[W] = {ur[i]};
        yr[i] = Op(load(g_lane), load(u_lane))[0];
      }
    }
  });
}

// Elements between rows of a float32 array whose rows (last axis) are each
// contiguous and evenly spaced, like the halves of a split gate/up output;
// -1 for any other array (it is copied to row-major float32 instead).
int64_t row_stride(const mx::array& a) {
  const int nd = a.ndim();
  if (a.dtype() != mx::float32 || nd == 0 || a.strides()[nd - 1] != 1) return -1;
  if (nd == 1) return a.shape(0);
  for (int i = 0; i + 2 < nd; ++i)
    if (a.strides()[i] != a.strides()[i + 1] * int64_t(a.shape(i + 1))) return -1;
  return a.strides()[nd - 2];
}

}  // namespace

void gated_into(const mx::array& gate, const mx::array& up, char* out, mx::Dtype dtype,
                int64_t n, GateAct act) {
  const int64_t D = gate.ndim() ? gate.shape(-1) : 1;
  const int64_t rows = D ? n / D : 0;
  std::vector<float> g_buf, u_buf;
  int64_t ldg = row_stride(gate), ldu = row_stride(up);
  const float* g = ldg >= 0 ? gate.data<float>() : (ldg = D, rows_as_float(gate, g_buf));
  const float* u = ldu >= 0 ? up.data<float>() : (ldu = D, rows_as_float(up, u_buf));
  const bool direct = dtype == mx::float32;
  std::vector<float> y_buf(direct ? 0 : n);
  float* y = direct ? reinterpret_cast<float*>(out) : y_buf.data();
  auto run = act == GateAct::silu        ? gated_rows<silu_mul>
             : act == GateAct::gelu_tanh ? gated_rows<gelu_mul>
                                         : gated_rows<clip_add>;
  run(g, ldg, u, ldu, rows, D, y);
  if (!direct) store_any(out, elem_of(dtype), y, n);
}

void gated_into(const mx::array& gate, const mx::array& up, mx::array& out, GateAct act) {
  gated_into(gate, up, out.data<char>(), out.dtype(), int64_t(out.size()), act);
}

void swiglu_rows(const float* g, int64_t ldg, const float* u, int64_t ldu, int64_t rows,
                 int64_t D, float* y) {
  gated_rows<silu_mul>(g, ldg, u, ldu, rows, D, y);
}

void Swiglu::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (auto& a : inputs) encoder.set_input_array(a);
  encoder.set_output_array(out);
  encoder.dispatch([gate = inputs[0], up = inputs[1], out, act = act_]() mutable {
    guarded(out, [&] { gated_into(gate, up, out, act); });
  });
}

void Swiglu::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("KvchatSwiglu runs on the CPU only");
}

namespace {

mx::array gated(const mx::array& gate, const mx::array& up, GateAct act, const char* op,
                mx::StreamOrDevice s) {
  if (gate.shape() != up.shape() || !is_float_dtype(gate.dtype()) ||
      !is_float_dtype(up.dtype()))
    throw std::invalid_argument(std::string(op) +
                                ": gate and up must be float arrays of one shape");
  auto stream = mx::to_stream(s, mx::Device::cpu);
  // clip_residual casts its sum back to float16 whatever y's dtype
  const mx::Dtype dtype = act == GateAct::clip_add ? mx::float16
                                                   : mx::promote_types(gate.dtype(), up.dtype());
  return mx::array(gate.shape(), dtype, std::make_shared<Swiglu>(stream, act), {gate, up});
}

}  // namespace

mx::array swiglu(const mx::array& gate, const mx::array& up, mx::StreamOrDevice s) {
  return gated(gate, up, GateAct::silu, "swiglu", s);
}

mx::array gelu_tanh_mul(const mx::array& gate, const mx::array& up, mx::StreamOrDevice s) {
  return gated(gate, up, GateAct::gelu_tanh, "gelu_tanh_mul", s);
}

mx::array clip_add(const mx::array& x, const mx::array& y, mx::StreamOrDevice s) {
  return gated(x, y, GateAct::clip_add, "clip_add", s);
}

}  // namespace kvchat
