// Gemma 3's layer after attention in one node. A Gemma decode step was ~28 nodes a layer
// (o_proj, three norms, two residual sums, gate, up, the GELU product, down, reshapes) at
// several us of dispatch each; this computes the same ops one after another in one task,
// each result rounded to the dtype its own op gives, so the outputs are bit-identical.
// Like `layer_tail`, a prefill chunk runs 64 rows at a time when every linear is tiled
// (a tiled matmul gives a row the same bits whatever rows run with it): the MLP's
// activations then exist for 64 rows, not the chunk's 512.
#include <algorithm>
#include <cstring>
#include <stdexcept>

#include "gemma_tail.h"
#include "kernels.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "tensor.h"

namespace kvchat {

namespace {

// The inputs, in order.
enum : int { H, ATT, O = 2, N1 = 5, N2 = 6, GATE = 7, UP = 10, DOWN = 13, N3 = 16 };

struct Bufs {
  mx::array rows, hin, ao, n1, h1, x2, g, u, act, dn, n3;
};

Bufs bufs_for(const std::vector<mx::array>& in, int r) {
  const mx::array &h = in[H], &att = in[ATT];
  const int hidden = h.shape(2), F = in[GATE].shape(0);
  auto promote = [](const mx::array& a, const mx::array& b) {
    return mx::promote_types(a.dtype(), b.dtype());
  };
  mx::array rows = scratch({r, att.shape(1) * att.shape(3)}, att.dtype());
  mx::array hin = scratch({r, hidden}, h.dtype());
  mx::array ao = scratch({r, hidden}, after(rows, in[O + 1]));
  mx::array n1 = scratch({r, hidden}, promote(ao, in[N1]));
  mx::array h1 = scratch({r, hidden}, mx::float16);
  mx::array x2 = scratch({r, hidden}, promote(h1, in[N2]));
  mx::array g = scratch({r, F}, after(x2, in[GATE + 1]));
  mx::array u = scratch({r, F}, after(x2, in[UP + 1]));
  // the GELU product is computed in place over gate's rows where its dtype allows
  // (elementwise: each element is read before it is written), a third less memory
  mx::array act = promote(g, u) == g.dtype() ? g : scratch({r, F}, promote(g, u));
  mx::array dn = scratch({r, hidden}, after(act, in[DOWN + 1]));
  mx::array n3 = scratch({r, hidden}, promote(dn, in[N3]));
  return {rows, hin, ao, n1, h1, x2, g, u, act, dn, n3};
}

// Buffers for full passes of R rows and, when M is not a multiple of R, the last pass's
// (the first rows of the full ones).
std::vector<Bufs> pass_bufs(const std::vector<mx::array>& in, int64_t R, int64_t M) {
  std::vector<Bufs> bufs{bufs_for(in, int(R))};
  if (const int n = int(M % R)) {
    const Bufs& b = bufs[0];
    bufs.push_back({first_rows(b.rows, n), first_rows(b.hin, n), first_rows(b.ao, n),
                    first_rows(b.n1, n), first_rows(b.h1, n), first_rows(b.x2, n),
                    first_rows(b.g, n), first_rows(b.u, n), first_rows(b.act, n),
                    first_rows(b.dn, n), first_rows(b.n3, n)});
  }
  return bufs;
}

}  // namespace

void GemmaTail::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  const int64_t M = int64_t(inputs[H].size()) / inputs[H].shape(2);
  const bool tiled = std::all_of(specs_.begin(), specs_.end(),
                                 [](const LinearSpec& s) { return s.tiled; });
  const int64_t R = tail_rows(tiled, M);
  std::vector<Bufs> queued;  // see queued_scratch_rows
  if (M <= queued_scratch_rows()) queued = pass_bufs(inputs, R, M);
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (auto& a : inputs) encoder.set_input_array(a);
  encoder.set_output_array(out);
  encoder.dispatch([in = inputs, out, M, R, queued, eps = eps_, sp = specs_]() mutable {
    guarded(out, [&] {
      std::vector<Bufs> bufs = queued.empty() ? pass_bufs(in, R, M) : std::move(queued);
      std::vector<char> att_buf, h_buf;
      const char* att = static_cast<const char*>(row_major(in[ATT], att_buf));
      const char* h = static_cast<const char*>(row_major(in[H], h_buf));
      const size_t row = size_t(in[H].shape(2)) * in[H].itemsize();  // h and out: float16
      for (int64_t m0 = 0; m0 < M; m0 += R) {
        const int64_t n = std::min(R, M - m0);
        Bufs& b = bufs[n == R ? 0 : 1];
        heads_to_rows(att, in[ATT], m0, m0 + n, b.rows);
        std::memcpy(b.hin.data<char>(), h + m0 * row, n * row);
        linear(b.rows, &in[O], b.ao, sp[0]);
        rms_norm_into(b.ao, in[N1], b.n1, eps);
        gated_into(b.hin, b.n1, b.h1, GateAct::clip_add);
        rms_norm_into(b.h1, in[N2], b.x2, eps);
        linear(b.x2, &in[GATE], b.g, sp[1]);
        linear(b.x2, &in[UP], b.u, sp[2]);
        gated_into(b.g, b.u, b.act, GateAct::gelu_tanh);
        linear(b.act, &in[DOWN], b.dn, sp[3]);
        rms_norm_into(b.dn, in[N3], b.n3, eps);
        gated_into(b.h1, b.n3, out.data<char>() + m0 * row, mx::float16,
                   n * in[H].shape(2), GateAct::clip_add);
      }
    });
  });
}

void GemmaTail::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("KvchatGemmaTail runs on the CPU only");
}

mx::array gemma_tail(const mx::array& h, const mx::array& att, const std::vector<mx::array>& o,
                     const std::vector<mx::array>& norms, const std::vector<mx::array>& gate,
                     const std::vector<mx::array>& up, const std::vector<mx::array>& down,
                     float eps, const std::vector<LinearSpec>& specs, mx::StreamOrDevice s) {
  if (o.size() != 3 || gate.size() != 3 || up.size() != 3 || down.size() != 3 ||
      norms.size() != 3 || specs.size() != 4)
    throw std::invalid_argument("gemma_tail: linears are (w, scales, biases), three norms, "
                                "four specs (o, gate, up, down)");
  if (h.ndim() != 3 || h.dtype() != mx::float16 || att.ndim() != 4 ||
      !is_float_dtype(att.dtype()) || int64_t(att.shape(0)) * att.shape(2) != h.size() / h.shape(2))
    throw std::invalid_argument("gemma_tail: h (B0, L0, hidden) float16, att (B, H, L, D), "
                                "B L = B0 L0");
  const int hidden = h.shape(2);
  for (const auto& w : norms)
    if (w.ndim() != 1 || w.shape(0) != hidden || !is_float_dtype(w.dtype()))
      throw std::invalid_argument("gemma_tail: norms must be (hidden,) float");
  // each linear checked as `qmm` checks it, on an input of the dtype it gets
  const mx::Dtype x2 = mx::promote_types(mx::float16, norms[1].dtype());
  check_qmm(att.shape(1) * att.shape(3), att.dtype(), o[0], o[1], o[2], specs[0].group,
            specs[0].bits, specs[0].tiled);
  check_qmm(hidden, x2, gate[0], gate[1], gate[2], specs[1].group, specs[1].bits, specs[1].tiled);
  check_qmm(hidden, x2, up[0], up[1], up[2], specs[2].group, specs[2].bits, specs[2].tiled);
  const int F = gate[0].shape(0);
  if (o[0].shape(0) != hidden || up[0].shape(0) != F || down[0].shape(0) != hidden)
    throw std::invalid_argument("gemma_tail: o and down must give hidden, gate and up alike");
  const mx::Dtype act = mx::promote_types(mx::promote_types(x2, gate[1].dtype()),
                                          mx::promote_types(x2, up[1].dtype()));
  check_qmm(F, act, down[0], down[1], down[2], specs[3].group, specs[3].bits, specs[3].tiled);
  auto stream = mx::to_stream(s, mx::Device::cpu);
  return mx::array(h.shape(), mx::float16, std::make_shared<GemmaTail>(stream, eps, specs),
                   {h, att, o[0], o[1], o[2], norms[0], norms[1], gate[0], gate[1], gate[2],
                    up[0], up[1], up[2], down[0], down[1], down[2], norms[2]});
}

}  // namespace kvchat
