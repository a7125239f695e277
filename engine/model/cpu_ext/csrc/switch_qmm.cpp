// MoE expert matmuls in one node. The Python version grouped a call's rows by expert on the
// host (reading the router's choice: a sync per call, three a layer) and ran a `qmm` node
// per expert in use plus slices, a gather and a concatenation: ~30 nodes and a sync per
// call at decode (8 experts of 64). This reads the expert ids inside the task, gathers each
// expert's rows, multiplies them by its tiles (a view into the stacked weights, no copy)
// and scatters the rows back: the same `qmm_into` per expert, so the same bits.
#include <cstring>
#include <stdexcept>
#include <vector>

#include "kernels.h"
#include "layer_ops.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "switch_qmm.h"
#include "tensor.h"

namespace kvchat {

namespace {

// Expert e's slice of a stacked (E, ...) row-major array, sharing its buffer.
mx::array expert(const mx::array& stacked, int e) {
  const mx::Shape shape(stacked.shape().begin() + 1, stacked.shape().end());
  return shared_view(stacked, shape, int64_t(e) * (stacked.size() / stacked.shape(0)));
}

}  // namespace

void SwitchQmm::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (auto& a : inputs) encoder.set_input_array(a);
  encoder.set_output_array(out);
  encoder.dispatch([in = inputs, out, group = group_, bits = bits_]() mutable {
    guarded(out, [&] {
      const mx::array &x = in[0], &w = in[1], &scales = in[2], &biases = in[3];
      std::vector<char> x_buf, id_buf;
      const char* xs = static_cast<const char*>(row_major(x, x_buf));
      const auto* ids = static_cast<const int32_t*>(row_major(in[4], id_buf));
      const int64_t P = in[4].size(), R = x.shape(0), K = x.shape(1), N = out.shape(1);
      const int64_t per = P / R;  // pairs a row serves
      const int E = w.shape(0);
      std::vector<std::vector<int64_t>> pairs(E);
      for (int64_t p = 0; p < P; ++p) {
        if (ids[p] < 0 || ids[p] >= E) throw std::out_of_range("switch_qmm: expert id");
        pairs[ids[p]].push_back(p);
      }
      const size_t x_row = size_t(K) * x.itemsize(), o_row = size_t(N) * out.itemsize();
      const bool biased = biases.ndim() == scales.ndim();  // else one factor for all
      for (int e = 0; e < E; ++e) {
        const auto& ps = pairs[e];
        if (ps.empty()) continue;
        const int n = int(ps.size());
        mx::array xe = scratch({n, int(K)}, x.dtype());
        for (int i = 0; i < n; ++i)
          std::memcpy(xe.data<char>() + i * x_row, xs + (ps[i] / per) * x_row, x_row);
        mx::array oe = scratch({n, int(N)}, out.dtype());
        qmm_into(xe, expert(w, e), expert(scales, e), biased ? expert(biases, e) : biases, oe,
                 group, bits, true);
        for (int i = 0; i < n; ++i)
          std::memcpy(out.data<char>() + ps[i] * o_row, oe.data<char>() + i * o_row, o_row);
      }
    });
  });
}

void SwitchQmm::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("KvchatSwitchQmm runs on the CPU only");
}

mx::array switch_qmm(const mx::array& x, const mx::array& w, const mx::array& scales,
                     const mx::array& biases, const mx::array& indices, int group, int bits,
                     mx::StreamOrDevice s) {
  if (x.ndim() != 2 || w.ndim() != 3 || scales.ndim() != 3 ||
      (biases.ndim() != 3 && !(biases.ndim() == 2 && biases.size() == 1)))
    throw std::invalid_argument("switch_qmm: x (R, K); w, scales, biases stacked (E, ...)");
  if (indices.dtype() != mx::int32 || indices.ndim() != 1 || x.shape(0) == 0 ||
      indices.size() % x.shape(0) != 0)
    throw std::invalid_argument("switch_qmm: indices int32 (P,), P a multiple of x's rows");
  if (w.shape(0) != scales.shape(0) || (biases.ndim() == 3 && biases.shape(0) != w.shape(0)))
    throw std::invalid_argument("switch_qmm: w, scales and biases of as many experts");
  // expert 0's slices, shapes only, checked as `qmm` checks a layer
  auto slice = [](const mx::array& a) {
    return mx::array(mx::Shape(a.shape().begin() + 1, a.shape().end()), a.dtype(), nullptr, {});
  };
  check_qmm(x.shape(1), x.dtype(), slice(w), slice(scales),
            biases.ndim() == 3 ? slice(biases) : biases, group, bits, true);
  auto stream = mx::to_stream(s, mx::Device::cpu);
  return mx::array({int(indices.size()), w.shape(1)},
                   mx::promote_types(x.dtype(), param_dtype(scales)),
                   std::make_shared<SwitchQmm>(stream, group, bits), {x, w, scales, biases, indices});
}

}  // namespace kvchat
