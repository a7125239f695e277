// The PagedResidual primitive: argument checks, and eval_cpu handing the call on MLX's CPU
// stream to the decode kernel (paged_residual_kernel.cpp) or, for L > 1 queries a
// sequence, the prefill route (paged_residual_prefill.cpp).
#include "paged_residual.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "kernels.h"
#include "ops.h"
#include "paged_residual_kernel.h"
#include "tensor.h"

namespace kvchat {

namespace {

struct Flags {
  float scale;
  int k_bits, v_bits, v_group, window, block_size;
  bool sinks, rotate_k, rotate_v;
};

// inputs: queries, k_codes, k_scales, k_biases, v_rows, v_scales, v_biases, res_k, res_v,
// res_map, block_tables, context_lens[, signs][, sinks]
void run(const std::vector<mx::array>& in, mx::array& out, const Flags& f) {
  std::vector<char> bufs[12];
  std::vector<float> q_buf, sign_buf, sink_buf;
  ResidualProblem pb{};
  const mx::array& queries = in[0];
  pb.B = queries.shape(0);
  pb.Hq = queries.shape(1);
  pb.D = queries.shape(3);
  const int L = queries.shape(2);
  pb.Hkv = in[1].shape(0);
  pb.num_blocks = in[1].shape(1);
  pb.BS = f.block_size > 0 ? f.block_size : in[4].shape(2);  // 3-d stores: (H, nb * BS, .)
  const int64_t q_size = int64_t(pb.B) * pb.Hq * L * pb.D;
  const float* q = rows_as_float(queries, q_buf);
  std::vector<float> qp(q, q + q_size), qk;
  for (float& x : qp) x *= f.scale;
  size_t next = 12;
  pb.signs = f.rotate_k || f.rotate_v ? rows_as_float(in[next++], sign_buf) : nullptr;
  pb.sinks = f.sinks ? rows_as_float(in[next++], sink_buf) : nullptr;
  pb.q = qp.data();
  pb.qk = qp.data();
  if (f.rotate_k) {  // (q R) . (k R) = q . k
    qk.resize(size_t(q_size));
    for (int64_t r = 0; r < q_size / pb.D; ++r)
      hadamard_row(qp.data() + r * pb.D, qk.data() + r * pb.D, pb.D, pb.signs, false);
    pb.qk = qk.data();
  }
  pb.k_codes = static_cast<const uint8_t*>(row_major(in[1], bufs[1]));
  pb.k_scales = row_major(in[2], bufs[2]);
  pb.k_biases = row_major(in[3], bufs[3]);
  pb.k_elem = elem_of(in[2].dtype());
  pb.k_bits = f.k_bits;
  pb.k_width = pb.BS * f.k_bits / 8;
  pb.v = make_side(in[4], &in[5], &in[6], QuantSide{f.v_bits, f.v_group}, pb.D, bufs + 4);
  pb.res_k = row_major(in[7], bufs[7]);
  pb.res_v = row_major(in[8], bufs[8]);
  pb.res_elem = elem_of(in[7].dtype());
  pb.nres = f.block_size > 0 ? in[7].shape(1) / pb.BS : in[7].shape(1);
  pb.res_map = static_cast<const int32_t*>(row_major(in[9], bufs[9]));
  pb.tables = static_cast<const int32_t*>(row_major(in[10], bufs[10]));
  pb.table_width = in[10].shape(1);
  pb.lens = static_cast<const int32_t*>(row_major(in[11], bufs[11]));
  pb.rotate_k = f.rotate_k;
  pb.rotate_v = f.rotate_v;
  pb.window = f.window;
  const int group = pb.Hq / pb.Hkv;
  pb.heads_per_task = std::min(group, kResidualMaxHeads);
  pb.head_chunks = (group + pb.heads_per_task - 1) / pb.heads_per_task;
  for (int b = 0; b < pb.B; ++b)
    if (pb.lens[b] < L || int64_t(pb.lens[b]) > pb.table_width * pb.BS) {
      fill_nan(out);  // nothing valid to read
      return;
    }
  std::vector<float> o_buf;
  float* o = out.dtype() == mx::float32 ? out.data<float>() : (o_buf.resize(q_size), o_buf.data());
  if (L == 1)
    run_residual_decode(pb, o);
  else
    run_residual_prefill(pb, L, o);
  if (out.dtype() != mx::float32) store_any(out.data<char>(), elem_of(out.dtype()), o, q_size);
}

void check(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("paged_residual: " + what);
}

}  // namespace

void PagedResidual::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (auto& a : inputs) encoder.set_input_array(a);
  encoder.set_output_array(out);
  const Flags f{scale_, k_bits_, v_bits_, v_group_, window_, block_size_,
                sinks_, rotate_k_, rotate_v_};
  encoder.dispatch([inputs, out, f]() mutable { guarded(out, [&] { run(inputs, out, f); }); });
}

void PagedResidual::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("KvchatPagedResidual runs on the CPU only");
}

bool PagedResidual::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const PagedResidual&>(other);
  return scale_ == o.scale_ && k_bits_ == o.k_bits_ && v_bits_ == o.v_bits_ &&
         v_group_ == o.v_group_ && sinks_ == o.sinks_ && rotate_k_ == o.rotate_k_ &&
         rotate_v_ == o.rotate_v_ && window_ == o.window_ && block_size_ == o.block_size_;
}

mx::array paged_residual(
    const mx::array& queries, const mx::array& k_codes, const mx::array& k_scales,
    const mx::array& k_biases, const mx::array& v_rows, const mx::array& v_scales,
    const mx::array& v_biases, const mx::array& res_k, const mx::array& res_v,
    const mx::array& res_map, const mx::array& block_tables, const mx::array& context_lens,
    float scale, int k_bits, int v_bits, int v_group, const std::optional<mx::array>& sinks,
    const std::optional<mx::array>& rotation, bool rotate_k, bool rotate_v, int window,
    int block_size, mx::StreamOrDevice s) {
  check(queries.ndim() == 4 && queries.shape(2) >= 1 && is_float_dtype(queries.dtype()),
        "queries must be float (B, Hq, L, D)");
  const int B = queries.shape(0), Hq = queries.shape(1), D = queries.shape(3);
  check(block_size >= 0, "block_size must be >= 0");
  // block_size > 0: the per-row stores 3-d as kept, (H, blocks * block_size, .); each is
  // checked through its 4-d shape (H, blocks, block_size, .), the layout the kernel reads
  const int rows_ndim = block_size > 0 ? 3 : 4;
  check(k_codes.ndim() == 4 && v_rows.ndim() == rows_ndim && res_k.ndim() == rows_ndim,
        block_size > 0 ? "k_codes must be 4-d, the other stores 3-d (H, blocks * block_size, .)"
                       : "pools must be 4-d");
  auto blocked = [block_size](const mx::array& a) {
    if (block_size == 0 || a.ndim() != 3 || a.shape(1) % block_size != 0) return a.shape();
    return mx::Shape({a.shape(0), a.shape(1) / block_size, block_size, a.shape(2)});
  };
  const int Hkv = k_codes.shape(0), nb = k_codes.shape(1);
  const int BS = block_size > 0 ? block_size : v_rows.shape(2);
  check((D == kResidualHeadDims[0] || D == kResidualHeadDims[1]) && Hkv > 0 && Hq % Hkv == 0,
        "head dim must be 64 or 128 and Hq a multiple of Hkv");
  check(BS > 0 && BS % W == 0, "block size must be a multiple of 16");
  check((k_bits == 4 || k_bits == 8) && k_codes.dtype() == mx::uint8 &&
            k_codes.shape() == mx::Shape({Hkv, nb, D, BS * k_bits / 8}),
        "k_codes must be uint8 (Hkv, num_blocks, D, block_size * k_bits / 8)");
  check(is_float_dtype(k_scales.dtype()) && k_biases.dtype() == k_scales.dtype() &&
            k_scales.shape() == mx::Shape({Hkv, nb, D}) && k_biases.shape() == k_scales.shape(),
        "k_scales and k_biases must be float (Hkv, num_blocks, D)");
  check((v_bits == 4 || v_bits == 8) && v_group > 0 && v_group % 32 == 0 && D % v_group == 0 &&
            v_rows.dtype() == mx::uint32 &&
            blocked(v_rows) == mx::Shape({Hkv, nb, BS, D * v_bits / 32}),
        "v_rows must be packed uint32 (Hkv, num_blocks, block_size, D * v_bits / 32)");
  check(is_float_dtype(v_scales.dtype()) && v_biases.dtype() == v_scales.dtype() &&
            blocked(v_scales) == mx::Shape({Hkv, nb, BS, D / v_group}) &&
            v_biases.shape() == v_scales.shape(),
        "v_scales and v_biases must be float (Hkv, num_blocks, block_size, D / v_group)");
  const mx::Shape res_shape = blocked(res_k);
  check(is_float_dtype(res_k.dtype()) && res_v.dtype() == res_k.dtype() &&
            res_shape.size() == 4 && res_shape[0] == Hkv && res_shape[2] == BS &&
            res_shape[3] == D && res_v.shape() == res_k.shape(),
        "res_k and res_v must be float (Hkv, num_residual, block_size, D)");
  check(res_map.ndim() == 1 && res_map.shape(0) == nb && res_map.dtype() == mx::int32,
        "res_map must be int32 (num_blocks,)");
  check(block_tables.ndim() == 2 && block_tables.shape(0) == B &&
            block_tables.dtype() == mx::int32,
        "block_tables must be int32 (B, max_blocks)");
  check(context_lens.ndim() == 1 && context_lens.shape(0) == B &&
            context_lens.dtype() == mx::int32,
        "context_lens must be int32 (B,)");
  check(!sinks || (sinks->ndim() == 1 && sinks->shape(0) == Hq), "sinks must be (Hq,)");
  check(window >= 0, "window must be >= 0");
  check(!(rotate_k || rotate_v) || (rotation && rotation->ndim() == 1 &&
                                    rotation->shape(0) == D && rotation->dtype() == mx::float32 &&
                                    (D & -D) >= 16),
        "a rotation needs R's (D,) float32 signs");
  std::vector<mx::array> inputs = {queries, k_codes, k_scales, k_biases, v_rows, v_scales,
                                   v_biases, res_k, res_v, res_map, block_tables, context_lens};
  if (rotate_k || rotate_v) inputs.push_back(*rotation);
  auto stream = mx::to_stream(s, mx::Device::cpu);
  if (sinks) inputs.push_back(mx::astype(*sinks, mx::float32, stream));
  return mx::array(queries.shape(), queries.dtype(),
                   std::make_shared<PagedResidual>(stream, scale, k_bits, v_bits, v_group,
                                                   window, block_size, bool(sinks), rotate_k,
                                                   rotate_v),
                   std::move(inputs));
}

}  // namespace kvchat
