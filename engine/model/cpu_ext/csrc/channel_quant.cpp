// Keys quantized per channel within a block (engine/kvcache/channel_quant.py) as one
// primitive, for the blocks a residual pool's write fills: gathered from the side store,
// rotated (`rotation.rotate`, rounded to the store's dtype as that op's output is), and
// quantized, bit for bit what `quantize_channels` computes from them. MLX's route was ~20
// nodes a layer (gathers, the rotation, min, max, divide, round, clip, packing), ~0.4 ms
// of every block-filling decode step's layer.
#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <vector>

#include "kernels.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "ops.h"
#include "simd.h"
#include "tensor.h"

namespace kvchat {

namespace {

// res (H, R * bs, D): residual rows; at (n,): the residual row (block of bs rows) of each
// filled block; outs: codes (H, n, D, bs * bits / 8) uint8, scales and biases (H, n, D).
void quantize(const mx::array& res, const mx::array& at, const float* signs, int bits,
              std::vector<mx::array>& outs) {
  const int H = res.shape(0), D = res.shape(2), n = at.shape(0);
  const int bs = outs[0].shape(3) * 8 / bits;
  const int64_t R = res.shape(1) / bs;
  const Elem elem = elem_of(res.dtype());
  const float levels = float((1 << bits) - 1);
  std::vector<char> at_buf, res_buf;
  const int32_t* rows = static_cast<const int32_t*>(row_major(at, at_buf));
  const char* src = static_cast<const char*>(row_major(res, res_buf));
  const int esz = int(res.itemsize());
  uint8_t* codes = outs[0].data<uint8_t>();
  std::vector<float> x(size_t(bs) * D), tmp(D), params(2 * size_t(D));
  std::vector<char> rounded(size_t(D) * esz);
  for (int h = 0; h < H; ++h)
    for (int j = 0; j < n; ++j) {
      const int64_t r = std::clamp<int64_t>(rows[j], 0, R - 1);  // the engine's rows fit
      for (int t = 0; t < bs; ++t) {
        const int64_t row = (int64_t(h) * R + r) * bs + t;
        float* xr = x.data() + size_t(t) * D;
        for (int d = 0; d < D; ++d) xr[d] = scalar_any(src, elem, row * D + d);
        if (signs == nullptr) continue;
        hadamard_row(xr, tmp.data(), D, signs, false);  // then rounded as the op's output
        store_any(rounded.data(), elem, tmp.data(), D);
        for (int d = 0; d < D; ++d) xr[d] = scalar_any(rounded.data(), elem, d);
      }
      const int64_t p0 = (int64_t(h) * n + j) * D;
      for (int d = 0; d < D; ++d) {
        float lo = x[d], hi = x[d];
        for (int t = 1; t < bs; ++t) {
          lo = std::min(lo, x[size_t(t) * D + d]);
          hi = std::max(hi, x[size_t(t) * D + d]);
        }
        params[d] = (hi - lo) / levels;  // stored as float16, and used as stored
        params[D + d] = lo;
      }
      store_any(outs[1].data<char>() + p0 * 2, Elem::f16, params.data(), D);
      store_any(outs[2].data<char>() + p0 * 2, Elem::f16, params.data() + D, D);
      for (int d = 0; d < D; ++d) {
        float s = scalar_any(outs[1].data<char>(), Elem::f16, p0 + d);
        const float b = scalar_any(outs[2].data<char>(), Elem::f16, p0 + d);
        s = s > 0.0f ? s : 1.0f;  // a constant channel: every code 0
        uint8_t* c = codes + (p0 + d) * (int64_t(bs) * bits / 8);
        for (int t = 0; t < bs; ++t) {
          const float q = std::nearbyint((x[size_t(t) * D + d] - b) / s);
          const uint8_t code = uint8_t(std::clamp(q, 0.0f, levels));
          if (bits == 8)
            c[t] = code;
          else if (t % 2 == 0)
            c[t / 2] = code;
          else
            c[t / 2] |= uint8_t(code << 4);
        }
      }
    }
}

class ChannelQuant : public mx::Primitive {
 public:
  ChannelQuant(mx::Stream stream, int bits) : mx::Primitive(stream), bits_(bits) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    for (auto& o : outputs) o.set_data(mx::allocator::malloc(o.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (auto& a : inputs) encoder.set_input_array(a);
    for (auto& o : outputs) encoder.set_output_array(o);
    encoder.dispatch([in = inputs, outs = outputs, bits = bits_]() mutable {
      try {
        std::vector<float> s_buf;
        const float* signs = in.size() > 2 ? rows_as_float(in[2], s_buf) : nullptr;
        quantize(in[0], in[1], signs, bits, outs);
      } catch (...) {  // an exception must not leave a dispatched task
        for (size_t i = 1; i < outs.size(); ++i) fill_nan(outs[i]);
      }
    });
  }
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("KvchatChannelQuant runs on the CPU only");
  }
  const char* name() const override {
    return "KvchatChannelQuant";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    return bits_ == static_cast<const ChannelQuant&>(other).bits_;
  }

 private:
  int bits_;
};

}  // namespace

std::vector<mx::array> channel_quant(const mx::array& res, const mx::array& at, int block_size,
                                     int bits, const std::optional<mx::array>& signs,
                                     mx::StreamOrDevice s) {
  if (res.ndim() != 3 || !is_float_dtype(res.dtype()) || block_size < 2 ||
      res.shape(1) % block_size != 0)
    throw std::invalid_argument("channel_quant: res must be float (H, rows * block_size, D)");
  if (at.ndim() != 1 || at.dtype() != mx::int32)
    throw std::invalid_argument("channel_quant: at must be int32 (n,)");
  if ((bits != 4 && bits != 8) || block_size * bits % 8 != 0)
    throw std::invalid_argument("channel_quant: bits must be 4 or 8 (whole bytes a channel)");
  const int H = res.shape(0), D = res.shape(2), n = at.shape(0);
  if (signs && (signs->ndim() != 1 || signs->shape(0) != D || signs->dtype() != mx::float32))
    throw std::invalid_argument("channel_quant: signs must be float32 (D,)");
  std::vector<mx::array> inputs = {res, at};
  if (signs) inputs.push_back(*signs);
  auto stream = mx::to_stream(s, mx::Device::cpu);
  return mx::array::make_arrays({{H, n, D, block_size * bits / 8}, {H, n, D}, {H, n, D}},
                                {mx::uint8, mx::float16, mx::float16},
                                std::make_shared<ChannelQuant>(stream, bits), inputs);
}

}  // namespace kvchat
