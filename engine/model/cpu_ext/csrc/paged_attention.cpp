// The PagedAttention primitive: argument checks, and eval_cpu handing the
// problem on MLX's CPU stream to the decode kernel (L == 1,
// paged_decode_kernel.cpp) or the causal prefill kernel (paged_prefill_kernel.cpp).
#include <algorithm>
#include <stdexcept>
#include <string>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "kernels.h"
#include "ops.h"
#include "paged_decode_kernel.h"
#include "tensor.h"

namespace kvchat {

namespace {

// v rounded to the dtype `e` in place (a no-op for float32).
void round_to(Elem e, float* v, int64_t n) {
  if (e == Elem::f32) return;
  uint16_t h[W];
  for (int64_t i = 0; i < n; i += W) {
    const int m = int(std::min<int64_t>(W, n - i));
    store_any(h, e, v + i, m);
    for (int j = 0; j < m; ++j) v[i + j] = scalar_any(h, e, j);
  }
}

// Decode rows that are one sequence's newest positions, as speculative decoding verifies
// drafts (the same block table, lengths n - B + 1 .. n): one folded problem reads the K/V
// once for all of them where each row would read them again.
bool one_sequence(const Problem& pb) {
  if (pb.B < 2 || pb.B > max_fold() || pb.window != 0) return false;
  for (int b = 1; b < pb.B; ++b)
    if (pb.lens[b] != pb.lens[0] + b ||
        !std::equal(pb.tables, pb.tables + pb.table_width, pb.tables + b * pb.table_width))
      return false;
  return true;
}

// `one_sequence`'s rows (B, Hq, 1, D) as one sequence's positions (1, Hq, B, D), folded.
void run_one_sequence(const Problem& pb, float* out) {
  const int B = pb.B, Hq = pb.Hq, D = pb.D;
  std::vector<float> q(size_t(B) * Hq * D), o(q.size());
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < Hq; ++h)
      std::copy_n(pb.q + (int64_t(b) * Hq + h) * D, D, q.data() + (int64_t(h) * B + b) * D);
  Problem f = pb;
  f.q = q.data();
  f.B = 1;
  f.L = B;
  f.lens = pb.lens + B - 1;
  run_problem(fold_positions(f), o.data());
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < Hq; ++h)
      std::copy_n(o.data() + (int64_t(h) * B + b) * D, D, out + (int64_t(b) * Hq + h) * D);
}

void run(const std::vector<mx::array>& inputs, mx::array& out, float scale, QuantSide kq,
         QuantSide vq, int window, bool sinks, bool rotate_q, bool unrotate_out, int block_size) {
  const mx::array& queries = inputs[0];
  const mx::array& k = inputs[1];
  const mx::array& v = inputs[2];
  size_t next = 5;
  const mx::array* ks = kq.bits ? &inputs[next++] : nullptr;
  const mx::array* kb = kq.bits ? &inputs[next++] : nullptr;
  const mx::array* vs = vq.bits ? &inputs[next++] : nullptr;
  const mx::array* vb_ = vq.bits ? &inputs[next++] : nullptr;
  const mx::array* signs_in = rotate_q || unrotate_out ? &inputs[next++] : nullptr;
  std::vector<float> sign_buf;
  const float* signs = signs_in ? rows_as_float(*signs_in, sign_buf) : nullptr;

  Problem pb{};
  std::vector<float> q_buf;
  std::vector<char> bufs[8];
  pb.q = rows_as_float(queries, q_buf);
  pb.B = queries.shape(0);
  pb.Hq = queries.shape(1);
  pb.L = queries.shape(2);
  pb.D = queries.shape(3);
  const int64_t q_rows = int64_t(pb.B) * pb.Hq * pb.L;
  std::vector<float> q_rot;
  if (rotate_q) {  // q R, rounded to the queries' dtype as `rotation.rotate` returns it
    q_rot.resize(size_t(q_rows) * pb.D);
    for (int64_t r = 0; r < q_rows; ++r)
      hadamard_row(pb.q + r * pb.D, q_rot.data() + r * pb.D, pb.D, signs, false);
    round_to(elem_of(queries.dtype()), q_rot.data(), int64_t(q_rot.size()));
    pb.q = q_rot.data();
  }
  pb.Hkv = k.shape(0);
  pb.BS = k.ndim() == 3 ? block_size : k.shape(2);  // 3-d: (Hkv, blocks * size, .) as stored
  pb.num_blocks = k.ndim() == 3 ? k.shape(1) / block_size : k.shape(1);
  pb.k = make_side(k, ks, kb, kq, pb.D, bufs);
  pb.v = make_side(v, vs, vb_, vq, pb.D, bufs + 3);
  pb.tables = static_cast<const int32_t*>(row_major(inputs[3], bufs[6]));
  pb.table_width = inputs[3].shape(1);
  pb.lens = static_cast<const int32_t*>(row_major(inputs[4], bufs[7]));
  pb.scale = scale;
  pb.window = window;
  std::vector<char> sink_buf;  // sinks are float32 (cast when the op was made)
  pb.sinks = sinks ? static_cast<const float*>(row_major(inputs.back(), sink_buf)) : nullptr;
  const int group = pb.Hq / pb.Hkv;
  pb.heads_per_task = std::min(group, kMaxHeadsPerTask);
  pb.head_chunks = (group + pb.heads_per_task - 1) / pb.heads_per_task;
  for (int b = 0; b < pb.B; ++b) {
    // A context shorter than its queries or longer than its table: nothing valid to read.
    if (pb.lens[b] < pb.L || int64_t(pb.lens[b]) > pb.table_width * pb.BS) {
      fill_nan(out);
      return;
    }
  }
  const int64_t size = int64_t(pb.B) * pb.Hq * pb.L * pb.D;
  std::vector<float> o_buf;
  float* o = out.dtype() == mx::float32 ? out.data<float>() : (o_buf.resize(size), o_buf.data());
  if (pb.L == 1 && one_sequence(pb))
    run_one_sequence(pb, o);
  else if (pb.L == 1)
    run_problem(pb, o);
  else  // never folded: a prompt's tail after a cached prefix must round as a cold prefill
    run_prefill(pb, o);
  if (unrotate_out) {  // o R^T, from the output rounded to its dtype as the op returned it
    round_to(elem_of(out.dtype()), o, size);
    std::vector<float> row(pb.D);
    for (int64_t r = 0; r < q_rows; ++r) {
      hadamard_row(o + r * pb.D, row.data(), pb.D, signs, true);
      std::copy(row.begin(), row.end(), o + r * pb.D);
    }
  }
  if (out.dtype() != mx::float32) store_any(out.data<char>(), elem_of(out.dtype()), o, size);
}

}  // namespace

Side make_side(const mx::array& rows, const mx::array* scales, const mx::array* biases,
               QuantSide quant, int D, std::vector<char>* bufs) {
  Side side{};
  side.data = static_cast<const char*>(row_major(rows, bufs[0]));
  side.D = D;
  side.bits = quant.bits;
  side.group = quant.group;
  if (quant.bits == 0) {
    side.elem = elem_of(rows.dtype());
  } else {
    side.row_bytes = int64_t(D) * quant.bits / 8;
    side.scales = row_major(*scales, bufs[1]);
    side.biases = row_major(*biases, bufs[2]);
    side.scale_elem = elem_of(scales->dtype());
  }
  return side;
}

void PagedAttention::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (auto& a : inputs) encoder.set_input_array(a);
  encoder.set_output_array(out);
  encoder.dispatch([inputs, out, scale = scale_, kq = k_, vq = v_, window = window_,
                    sinks = sinks_, rq = rotate_q_, ro = unrotate_out_,
                    bs = block_size_]() mutable {
    guarded(out, [&] { run(inputs, out, scale, kq, vq, window, sinks, rq, ro, bs); });
  });
}

void PagedAttention::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("KvchatPagedAttention runs on the CPU only");
}

bool PagedAttention::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const PagedAttention&>(other);
  return scale_ == o.scale_ && k_ == o.k_ && v_ == o.v_ && window_ == o.window_ &&
         sinks_ == o.sinks_ && rotate_q_ == o.rotate_q_ && unrotate_out_ == o.unrotate_out_ &&
         block_size_ == o.block_size_;
}

namespace {

void check_side(const mx::array& rows, const std::optional<mx::array>& scales,
                const std::optional<mx::array>& biases, int bits, int group, int Hkv, int D,
                const mx::Shape& pool_shape, const char* name) {
  const std::string what = std::string("paged_attention: ") + name;
  const int n = pool_shape.size(), w = n - 1;  // 4-d (Hkv, blocks, size, .) or 3-d as stored
  auto fits = [&](const mx::array& a) {
    return a.ndim() == n && a.shape(0) == Hkv && a.shape(1) == pool_shape[1] &&
           (n == 3 || a.shape(2) == pool_shape[2]);
  };
  if (!fits(rows)) throw std::invalid_argument(what + " must be (Hkv, num_blocks, block_size, .)");
  if (bits == 0) {
    if (!is_float_dtype(rows.dtype()) || rows.shape(w) != D)
      throw std::invalid_argument(what + " must be float rows of the head dim");
    return;
  }
  if ((bits != 4 && bits != 8) || group <= 0 || group % 32 != 0 || D % group != 0)
    throw std::invalid_argument(what + ": unsupported bits / group size");
  if (rows.dtype() != mx::uint32 || int64_t(rows.shape(w)) * 32 / bits != D)
    throw std::invalid_argument(what + " must be packed uint32 rows");
  if (!scales || !biases || !is_float_dtype(scales->dtype()) ||
      biases->dtype() != scales->dtype() || !fits(*scales) || scales->shape(w) != D / group ||
      biases->shape() != scales->shape())
    throw std::invalid_argument(what + " needs scales and biases (Hkv, nb, bs, D / group)");
}

}  // namespace

mx::array paged_attention(const mx::array& queries, const mx::array& k, const mx::array& v,
                       const mx::array& block_tables, const mx::array& context_lens,
                       float scale, const std::optional<mx::array>& k_scales,
                       const std::optional<mx::array>& k_biases, int k_bits, int k_group,
                       const std::optional<mx::array>& v_scales,
                       const std::optional<mx::array>& v_biases, int v_bits, int v_group,
                       int window, const std::optional<mx::array>& sinks,
                       const std::optional<mx::array>& rotation, bool rotate_queries,
                       bool unrotate_out, int block_size, mx::StreamOrDevice s) {
  if (queries.ndim() != 4 || queries.shape(2) < 1 || !is_float_dtype(queries.dtype()))
    throw std::invalid_argument("paged_attention: queries must be float (B, Hq, L, D)");
  const int B = queries.shape(0), Hq = queries.shape(1), D = queries.shape(3);
  if (k.ndim() != 4 && (k.ndim() != 3 || block_size <= 0 || k.shape(1) % block_size != 0))
    throw std::invalid_argument("paged_attention: pools must be 4-d, or 3-d (Hkv, blocks * "
                                "block_size, .) with their block_size");
  const int Hkv = k.shape(0);
  if (D % W != 0 || Hkv <= 0 || Hq % Hkv != 0)
    throw std::invalid_argument("paged_attention: head dim must be a multiple of 16 and "
                                "Hq a multiple of Hkv");
  check_side(k, k_scales, k_biases, k_bits, k_group, Hkv, D, k.shape(), "k");
  check_side(v, v_scales, v_biases, v_bits, v_group, Hkv, D, k.shape(), "v");
  if (block_tables.ndim() != 2 || block_tables.shape(0) != B ||
      block_tables.dtype() != mx::int32)
    throw std::invalid_argument("paged_attention: block_tables must be int32 (B, max_blocks)");
  if (context_lens.ndim() != 1 || context_lens.shape(0) != B ||
      context_lens.dtype() != mx::int32)
    throw std::invalid_argument("paged_attention: context_lens must be int32 (B,)");
  if (window < 0) throw std::invalid_argument("paged_attention: window must be >= 0");
  if (sinks && (sinks->ndim() != 1 || sinks->shape(0) != Hq))
    throw std::invalid_argument("paged_attention: sinks must be (Hq,)");
  if ((rotate_queries || unrotate_out) &&
      (!rotation || rotation->ndim() != 1 || rotation->shape(0) != D ||
       rotation->dtype() != mx::float32 || (D & -D) < 16))
    throw std::invalid_argument("paged_attention: a rotation needs R's (D,) float32 signs");
  std::vector<mx::array> inputs = {queries, k, v, block_tables, context_lens};
  if (k_bits) inputs.insert(inputs.end(), {*k_scales, *k_biases});
  if (v_bits) inputs.insert(inputs.end(), {*v_scales, *v_biases});
  if (rotate_queries || unrotate_out) inputs.push_back(*rotation);
  auto stream = mx::to_stream(s, mx::Device::cpu);
  if (sinks) inputs.push_back(mx::astype(*sinks, mx::float32, stream));
  return mx::array(queries.shape(), queries.dtype(),
                   std::make_shared<PagedAttention>(stream, scale, QuantSide{k_bits, k_group},
                                                 QuantSide{v_bits, v_group}, window,
                                                 bool(sinks), rotate_queries, unrotate_out,
                                                 k.ndim() == 3 ? block_size : 0),
                   std::move(inputs));
}

}  // namespace kvchat
