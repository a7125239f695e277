// A step's K and V rows written into every array of a layer's stores as one node.
//
// A float pool's writes were two nodes a layer (K, V) and a per-token quantized pool's six
// (three parts a side), each a few rows' work: the 116 extra write nodes of a q8 decode step
// of the default model measured ~0.8-1.1 ms of a ~5 ms step. Here they are one node with an
// output per array (measured in the README: float16 steps 1.5-5 % faster, q8/q4 7-13 %).
// Each array nobody else holds is written in place, any other copied first
// (`share_if_donated`, counting the copies of the inputs a multi-output primitive keeps).
#include <array>
#include <cstring>
#include <stdexcept>

#include "kv_write_parts.h"
#include "mlx/backend/cpu/encoder.h"
#include "tensor.h"

namespace kvchat {

namespace {

size_t parts(const SideFormat& f) {
  return f.bits ? 3 : 1;
}

// One side's arrays (pools .. pools + parts) into outs, donated[i] for each.
void write_side(const mx::array* pools, mx::array* outs, const bool* donated,
                const SideFormat& f, const mx::array& slots, const mx::array& rows,
                const mx::array* rotation) {
  if (f.bits == 0) {
    write_float_rows(pools[0], slots, rows, outs[0], donated[0]);
    return;
  }
  mx::array* out[3] = {&outs[0], &outs[1], &outs[2]};
  write_quant_parts(pools, slots, rows, f.rotate ? rotation : nullptr, out, donated,
                    QuantWrite{0, f.bits, f.group});
}

}  // namespace

void KvWriteSides::eval_cpu(const std::vector<mx::array>& inputs,
                            std::vector<mx::array>& outputs) {
  const size_t n = outputs.size();
  std::array<bool, 6> donated{};  // at most three arrays a side
  for (size_t i = 0; i < n; ++i) donated[i] = share_if_donated(inputs[i], outputs[i], n);
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (auto& a : inputs) encoder.set_input_array(a);
  for (auto& o : outputs) encoder.set_output_array(o);
  encoder.dispatch([in = inputs, outs = outputs, k = k_, v = v_, d = donated]() mutable {
    try {
      const size_t nk = parts(k), n = outs.size();
      const mx::array* rot = in.size() > n + 3 ? &in[n + 3] : nullptr;
      write_side(in.data(), outs.data(), d.data(), k, in[n], in[n + 1], rot);
      write_side(in.data() + nk, outs.data() + nk, d.data() + nk, v, in[n], in[n + 2], rot);
    } catch (...) {  // an exception must not leave a dispatched task; the rows stay unwritten
    }
  });
}

void KvWriteSides::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("KvchatKvWriteSides runs on the CPU only");
}

bool KvWriteSides::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const KvWriteSides&>(other);
  auto same = [](const SideFormat& a, const SideFormat& b) {
    return a.bits == b.bits && a.group == b.group && a.rotate == b.rotate;
  };
  return same(k_, o.k_) && same(v_, o.v_);
}

namespace {

void check_side(const std::vector<mx::array>& store, const mx::array& slots,
                const mx::array& rows, const std::optional<mx::array>& rotation,
                const SideFormat& f) {
  if (store.size() != parts(f))
    throw std::invalid_argument("kv_write_sides: a float side is one array, a quantized one "
                                "three (packed rows, scales, biases)");
  if (f.bits == 0) {
    check_float_write(store[0], slots, rows);
    return;
  }
  if (f.rotate && !rotation)
    throw std::invalid_argument("kv_write_sides: a rotated side needs R's signs");
  for (int p = 0; p < 3; ++p)
    check_quant_part(store[p], slots, rows, f.rotate ? rotation : std::nullopt, p, f.bits,
                     f.group);
}

}  // namespace

std::vector<mx::array> kv_write_sides(const std::vector<mx::array>& keys,
                                      const std::vector<mx::array>& values,
                                      const mx::array& slots, const mx::array& k_rows,
                                      const mx::array& v_rows,
                                      const std::optional<mx::array>& rotation, SideFormat k,
                                      SideFormat v, mx::StreamOrDevice s) {
  check_side(keys, slots, k_rows, rotation, k);
  check_side(values, slots, v_rows, rotation, v);
  std::vector<mx::array> inputs(keys);
  inputs.insert(inputs.end(), values.begin(), values.end());
  std::vector<mx::Shape> shapes;
  std::vector<mx::Dtype> dtypes;
  for (const auto& a : inputs) {
    shapes.push_back(a.shape());
    dtypes.push_back(a.dtype());
  }
  inputs.insert(inputs.end(), {slots, k_rows, v_rows});
  if ((k.rotate || v.rotate) && rotation) inputs.push_back(*rotation);
  auto stream = mx::to_stream(s, mx::Device::cpu);
  return mx::array::make_arrays(std::move(shapes), dtypes,
                                std::make_shared<KvWriteSides>(stream, k, v), inputs);
}

}  // namespace kvchat
