// A llama-family layer in two nodes around attention.
//
// A decode step of a small model is mostly dispatch: the default model's 30
// layers were ~19 graph nodes each (norms, four matmuls, RoPE, residual adds,
// splits, reshapes), ~3-8 us apiece against ~250 us of arithmetic per layer.
// `layer_head` and `layer_tail` run the same computations as those ops, one after
// another inside one task, each result rounded to the dtype its own op would have
// given, so the outputs are bit-identical to the separate ops. Attention and the
// K/V writes stay their own nodes (the attention route and its guard decide the
// kernel; a pool write must be its own node to update the pool in place).
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <stdexcept>

#include "layer_ops.h"
#include "kernels.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "tensor.h"

namespace kvchat {

static mx::Shape rows_of(const mx::array& x, int width) {
  return {int(x.size() / x.shape(-1)), width};
}

// out = a + b elementwise over n elements, in float32 rounded once to the dtype: MLX's
// add for these dtypes (two halves' sum is exact in float32).
static void add_into(const mx::array& a, const mx::array& b, char* out, mx::Dtype dtype,
                     int64_t n) {
  std::vector<float> a_buf, b_buf;
  const float* af = rows_as_float(a, a_buf);
  const float* bf = rows_as_float(b, b_buf);
  std::vector<float> y(n);
  for (int64_t i = 0; i < n; ++i) y[i] = af[i] + bf[i];
  store_any(out, elem_of(dtype), y.data(), n);
}

static void add_into(const mx::array& a, const mx::array& b, mx::array& out) {
  add_into(a, b, out.data<char>(), out.dtype(), int64_t(out.size()));
}

// A tail's intermediate arrays for R rows at a time.
struct TailBufs {
  mx::array rows, hin, ao, h1, x2, gu, act, dn;
};

static TailBufs tail_bufs(const std::vector<mx::array>& in, int64_t R) {
  const mx::array &h = in[0], &att = in[1];
  const int F = in[6].shape(0) / 2, hidden = h.shape(2), r = int(R);
  mx::array rows = scratch({r, att.shape(1) * att.shape(3)}, att.dtype());
  mx::array hin = scratch({r, hidden}, h.dtype());
  mx::array ao = scratch({r, in[2].shape(0)}, after(rows, in[3]));
  mx::array h1 = scratch({r, hidden}, mx::promote_types(h.dtype(), ao.dtype()));
  mx::array x2 = scratch({r, hidden}, mx::promote_types(h1.dtype(), in[5].dtype()));
  mx::array gu = scratch({r, 2 * F}, after(x2, in[7]));
  mx::array act = scratch({r, F}, gu.dtype());
  mx::array dn = scratch({r, in[9].shape(0)}, after(act, in[10]));
  return {rows, hin, ao, h1, x2, gu, act, dn};
}

// Buffers for full passes and, when M is not a multiple of R, the last pass's (the first
// rows of the full ones).
static std::vector<TailBufs> tail_pass_bufs(const std::vector<mx::array>& in, int64_t R,
                                            int64_t M) {
  std::vector<TailBufs> bufs{tail_bufs(in, R)};
  if (const int n = int(M % R)) {
    const TailBufs& b = bufs[0];
    bufs.push_back({first_rows(b.rows, n), first_rows(b.hin, n), first_rows(b.ao, n),
                    first_rows(b.h1, n), first_rows(b.x2, n), first_rows(b.gu, n),
                    first_rows(b.act, n), first_rows(b.dn, n)});
  }
  return bufs;
}

// The head's normed rows, its q/k/v product and, for separate q, k, v linears, each part.
struct HeadBufs {
  mx::array x, qkv;
  std::vector<mx::array> parts;
};

static HeadBufs head_bufs(const std::vector<mx::array>& in, int P) {
  const mx::array& h = in[0];
  mx::array x = scratch(h.shape(), mx::promote_types(h.dtype(), in[1].dtype()));
  auto qkv_shape = h.shape();
  qkv_shape.back() = 0;
  for (int i = 0; i < P; ++i) qkv_shape.back() += in[2 + 3 * i].shape(0);
  mx::array qkv = scratch(qkv_shape, after(x, in[3]));
  std::vector<mx::array> parts;  // q, k and v apart: each its own product, then interleaved
  for (int i = 0; P > 1 && i < P; ++i)
    parts.push_back(scratch(rows_of(h, in[2 + 3 * i].shape(0)), qkv.dtype()));
  return {x, qkv, parts};
}

void LayerHead::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  for (auto& o : outputs) o.set_data(mx::allocator::malloc(o.nbytes()));
  const int P = int(qkv_.size());
  const bool early =
      int64_t(inputs[0].size() / inputs[0].shape(-1)) <= queued_scratch_rows();
  std::optional<HeadBufs> queued;  // see queued_scratch_rows
  if (early) queued = head_bufs(inputs, P);
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (auto& a : inputs) encoder.set_input_array(a);
  for (auto& o : outputs) encoder.set_output_array(o);
  encoder.dispatch([in = inputs, outs = outputs, queued, eps = eps_, sp = qkv_,
                    hq = heads_, hkv = kv_heads_, p = rope_, P]() mutable {
    try {
      HeadBufs b = queued ? std::move(*queued) : head_bufs(in, P);
      mx::array &x = b.x, &qkv = b.qkv;
      std::vector<mx::array>& parts = b.parts;
      rms_norm_into(in[0], in[1], x, eps);
      if (P == 1) {
        linear(x, &in[2], qkv, sp[0]);
      } else {
        const size_t item = qkv.itemsize(), row = size_t(qkv.shape(-1)) * item;
        const int64_t M = int64_t(qkv.size()) / qkv.shape(-1);
        size_t at = 0;
        for (int i = 0; i < P; ++i) {
          linear(x, &in[2 + 3 * i], parts[i], sp[i]);
          const size_t width = size_t(parts[i].shape(-1)) * item;
          for (int64_t m = 0; m < M; ++m)
            std::memcpy(qkv.data<char>() + m * row + at, parts[i].data<char>() + m * width,
                        width);
          at += width;
        }
      }
      std::vector<float> f_buf;
      const size_t o = 2 + 3 * size_t(P);  // offsets, then freqs if given
      qkv_rope_into(qkv, in[o], outs, hq, hkv, p,
                    freqs_of(in.size() > o + 1 ? &in[o + 1] : nullptr, f_buf));
    } catch (...) {  // an exception must not leave a dispatched task
      for (auto& o : outs) fill_nan(o);
    }
  });
}

void LayerHead::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("KvchatLayerHead runs on the CPU only");
}

void LayerTail::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  const int64_t M = int64_t(inputs[0].size()) / inputs[0].shape(2);
  const int64_t R = tail_rows(o_.tiled && gate_up_.tiled && down_.tiled, M);
  std::vector<TailBufs> queued;  // see queued_scratch_rows
  if (M <= queued_scratch_rows()) queued = tail_pass_bufs(inputs, R, M);
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (auto& a : inputs) encoder.set_input_array(a);
  encoder.set_output_array(out);
  encoder.dispatch([in = inputs, out, M, R, queued, eps = eps_, o = o_, g = gate_up_,
                    d = down_]() mutable {
    guarded(out, [&] {
      std::vector<TailBufs> bufs =
          queued.empty() ? tail_pass_bufs(in, R, M) : std::move(queued);
      std::vector<char> att_buf, h_buf;
      const char* att = static_cast<const char*>(row_major(in[1], att_buf));
      const char* h = static_cast<const char*>(row_major(in[0], h_buf));
      const size_t h_row = size_t(in[0].shape(2)) * in[0].itemsize();
      const size_t out_row = size_t(out.shape(-1)) * out.itemsize();
      for (int64_t m0 = 0; m0 < M; m0 += R) {
        const int64_t n = std::min(R, M - m0);
        TailBufs& t = bufs[n == R ? 0 : 1];
        heads_to_rows(att, in[1], m0, m0 + n, t.rows);
        std::memcpy(t.hin.data<char>(), h + m0 * h_row, n * h_row);
        linear(t.rows, &in[2], t.ao, o);
        add_into(t.hin, t.ao, t.h1);
        rms_norm_into(t.h1, in[5], t.x2, eps);
        linear(t.x2, &in[6], t.gu, g);
        // swiglu(gate, up) of gu's two halves, as the split + `swiglu` ops compute it
        const int64_t F = t.act.shape(1);
        std::vector<float> gu_buf, y_buf;
        const float* guf = rows_as_float(t.gu, gu_buf);
        const bool direct = t.act.dtype() == mx::float32;
        float* y = direct ? t.act.data<float>() : (y_buf.resize(t.act.size()), y_buf.data());
        swiglu_rows(guf, 2 * F, guf + F, 2 * F, n, F, y);
        if (!direct) store_any(t.act.data<char>(), elem_of(t.act.dtype()), y, int64_t(t.act.size()));
        linear(t.act, &in[9], t.dn, d);
        add_into(t.h1, t.dn, out.data<char>() + m0 * out_row, out.dtype(), n * out.shape(-1));
      }
    });
  });
}

void LayerTail::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("KvchatLayerTail runs on the CPU only");
}

std::vector<mx::array> layer_head(const mx::array& h, const mx::array& norm,
                                  const std::vector<mx::array>& qkv,
                                  const std::vector<LinearSpec>& specs,
                                  const mx::array& offsets, float eps, int heads,
                                  int kv_heads, RopeParams rope,
                                  const std::optional<mx::array>& freqs, mx::StreamOrDevice s) {
  if (h.ndim() != 3 || !is_float_dtype(h.dtype()) || norm.ndim() != 1 ||
      norm.shape(0) != h.shape(2) || !is_float_dtype(norm.dtype()))
    throw std::invalid_argument("layer_head: h (B, L, hidden) and norm (hidden,) float");
  if (specs.empty() || qkv.size() != 3 * specs.size())
    throw std::invalid_argument("layer_head: each projection is (w, scales, biases) and a spec");
  int N = 0;
  for (size_t p = 0; p < specs.size(); ++p) {
    const LinearSpec& sp = specs[p];
    check_qmm(h.shape(2), h.dtype(), qkv[3 * p], qkv[3 * p + 1], qkv[3 * p + 2], sp.group,
              sp.bits, sp.tiled);
    if (param_dtype(qkv[3 * p + 1]) != param_dtype(qkv[1]))
      throw std::invalid_argument("layer_head: q, k and v scales of one dtype");
    N += qkv[3 * p].shape(0);
  }
  const int width = heads + 2 * kv_heads;
  if (heads <= 0 || kv_heads <= 0 || N % width != 0)
    throw std::invalid_argument("layer_head: the projection must be (heads + 2 kv_heads) * D");
  const int D = N / width, B = h.shape(0), L = h.shape(1);
  if (specs.size() == 3 && (qkv[0].shape(0) != heads * D || qkv[3].shape(0) != kv_heads * D))
    throw std::invalid_argument("layer_head: q, k and v apart must be heads, kv_heads and "
                                "kv_heads times D rows");
  if (rope.dims <= 0 || rope.dims % 2 != 0 || rope.dims > D)
    throw std::invalid_argument("layer_head: rope dims must be even, positive and <= D");
  if (offsets.dtype() != mx::int32 || offsets.ndim() > 1 ||
      (offsets.size() != 1 && int(offsets.size()) != B))
    throw std::invalid_argument("layer_head: offsets must be int32, one or one per row");
  check_freqs(freqs, rope.dims, "layer_head");
  const mx::Dtype t =
      mx::promote_types(mx::promote_types(h.dtype(), norm.dtype()), qkv[1].dtype());
  auto stream = mx::to_stream(s, mx::Device::cpu);
  auto prim = std::make_shared<LayerHead>(stream, eps, specs, heads, kv_heads, rope);
  const mx::Shape kv{kv_heads, B * L, D};
  std::vector<mx::array> inputs{h, norm};
  inputs.insert(inputs.end(), qkv.begin(), qkv.end());
  inputs.push_back(offsets);
  if (freqs) inputs.push_back(*freqs);
  return mx::array::make_arrays({{B, heads, L, D}, kv, kv}, {t, t, t}, prim, inputs);
}

mx::array layer_tail(const mx::array& h, const mx::array& att,
                     const std::vector<mx::array>& o, const mx::array& norm,
                     const std::vector<mx::array>& gate_up, const std::vector<mx::array>& down,
                     float eps, LinearSpec o_spec, LinearSpec gate_up_spec, LinearSpec down_spec,
                     mx::StreamOrDevice s) {
  if (o.size() != 3 || gate_up.size() != 3 || down.size() != 3)
    throw std::invalid_argument("layer_tail: each linear is (w, scales, biases)");
  if (h.ndim() != 3 || att.ndim() != 4 || !is_float_dtype(h.dtype()) ||
      !is_float_dtype(att.dtype()) || int64_t(att.shape(0)) * att.shape(2) != h.size() / h.shape(2))
    throw std::invalid_argument("layer_tail: h (B0, L0, hidden), att (B, H, L, D), B L = B0 L0");
  const int hidden = h.shape(2);
  if (norm.ndim() != 1 || norm.shape(0) != hidden || !is_float_dtype(norm.dtype()))
    throw std::invalid_argument("layer_tail: norm must be (hidden,) float");
  // each linear checked as `qmm` checks it, on an input of its width
  const mx::Dtype ht = h.dtype();
  check_qmm(att.shape(1) * att.shape(3), att.dtype(), o[0], o[1], o[2], o_spec.group,
            o_spec.bits, o_spec.tiled);
  if (o[0].shape(0) != hidden) throw std::invalid_argument("layer_tail: o_proj must give hidden");
  check_qmm(hidden, ht, gate_up[0], gate_up[1], gate_up[2], gate_up_spec.group, gate_up_spec.bits,
            gate_up_spec.tiled);
  const int F = gate_up[0].shape(0) / 2;
  if (F == 0 || gate_up[0].shape(0) % 2 != 0)
    throw std::invalid_argument("layer_tail: gate_up must be an even number of rows");
  check_qmm(F, ht, down[0], down[1], down[2], down_spec.group,
            down_spec.bits, down_spec.tiled);
  if (down[0].shape(0) != hidden) throw std::invalid_argument("layer_tail: down must give hidden");
  // the dtypes the separate ops give, step by step
  const mx::Dtype ao = mx::promote_types(att.dtype(), o[1].dtype());
  const mx::Dtype h1 = mx::promote_types(ht, ao);
  const mx::Dtype x2 = mx::promote_types(h1, norm.dtype());
  const mx::Dtype gu = mx::promote_types(x2, gate_up[1].dtype());
  const mx::Dtype dn = mx::promote_types(gu, down[1].dtype());
  auto stream = mx::to_stream(s, mx::Device::cpu);
  return mx::array(h.shape(), mx::promote_types(h1, dn),
                   std::make_shared<LayerTail>(stream, eps, o_spec, gate_up_spec, down_spec),
                   {h, att, o[0], o[1], o[2], norm, gate_up[0], gate_up[1], gate_up[2], down[0],
                    down[1], down[2]});
}

}  // namespace kvchat
