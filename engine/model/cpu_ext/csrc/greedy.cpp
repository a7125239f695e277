// Greedy token choice without a logsumexp per row (the CPU fast path).
//
// mlx-lm's greedy sampler takes argmax(logits - logsumexp(logits)). On MLX's
// CPU backend that logsumexp costs ~1.3 ms a row for a 49k vocabulary (a
// scalar exp per entry), a cost per sequence that batching cannot share.
// Subtracting one value c from a row is monotonic, so the first maximum of the
// raw logits is always a maximum of the log-probs; the choice can differ only
// if rounding makes an earlier entry equal to it. With a row maximum
// m >= ln(V) + 1, c lies in [m, m + ln V] <= 2m, so every entry within a
// factor 2 of c (every candidate for a tie) is subtracted exactly (Sterbenz)
// and no tie appears: the raw argmax is the answer. Below that, c - m still lies
// in [0, B] (B = ln V + 1, plus c's own rounding), so x - c and m - c round to
// one value only if m - x is under one step of the dtype at B: with no earlier
// entry that close to m (4 steps, to spare), the raw argmax is the answer too.
// Other rows (a near tie, an inf or a nan) get -1 and the caller computes
// mlx-lm's formula for them. Rows are rarely left over, which lets a pipelined
// decode step feed its picks on unread (executor.py).
#include <cmath>
#include <stdexcept>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "ops.h"
#include "tensor.h"

namespace kvchat {

namespace {

// The row's greedy token where it provably equals mlx-lm's, else -1.
int32_t pick_row(const void* base, Elem e, int64_t row0, int64_t V) {
  // Per lane: its maximum and where it first occurs; poison sums x * 0, which is
  // nan iff the row holds an inf or a nan.
  vf vmax = splat(-INFINITY), poison{};
  vi vidx{}, lane;
  for (int k = 0; k < W; ++k) lane[k] = k;
  int64_t i = 0;
  for (; i + W <= V; i += W) {
    const vf x = load_any(base, e, row0 + i);
    const vi idx = lane + int32_t(i);
    const vi greater = x > vmax;
    vmax = greater ? x : vmax;
    vidx = greater ? idx : vidx;
    poison += x * 0.0f;
  }
  float m = -INFINITY, bad = 0.0f;
  int64_t at = -1;
  for (int k = 0; k < W; ++k) {
    bad += poison[k];
    if (vmax[k] > m || (vmax[k] == m && vidx[k] < at)) m = vmax[k], at = vidx[k];
  }
  for (; i < V; ++i) {  // the tail comes after every lane's entries: strictly greater wins
    const float x = scalar_any(base, e, row0 + i);
    bad += x * 0.0f;
    if (x > m) m = x, at = i;
  }
  if (std::isnan(bad) || at < 0) return -1;
  const float sure = std::log(float(V)) + 1.0f;
  if (m >= sure) return int32_t(at);
  // the dtype's step at B: 2^(exponent of B - mantissa bits)
  const int mantissa = e == Elem::f32 ? 23 : e == Elem::f16 ? 10 : 7;
  const float B = sure + std::ldexp(std::fabs(m) + sure, -mantissa);
  const float near = 4.0f * std::ldexp(1.0f, std::ilogb(B) - mantissa);
  for (int64_t j = 0; j < at; ++j)
    if (scalar_any(base, e, row0 + j) >= m - near) return -1;
  return int32_t(at);
}

}  // namespace

void GreedyPick::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  encoder.set_input_array(inputs[0]);
  encoder.set_output_array(out);
  encoder.dispatch([logits = inputs[0], out]() mutable {
    int32_t* dst = out.data<int32_t>();
    const int64_t V = logits.shape(-1), rows = V ? int64_t(logits.size()) / V : 0;
    try {
      std::vector<char> scratch;
      const void* base = row_major(logits, scratch);
      const Elem e = elem_of(logits.dtype());
      for (int64_t r = 0; r < rows; ++r) dst[r] = pick_row(base, e, r * V, V);
    } catch (...) {  // an exception must not leave a dispatched task: ask for the exact path
      for (int64_t r = 0; r < rows; ++r) dst[r] = -1;
    }
  });
}

void GreedyPick::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("KvchatGreedyPick runs on the CPU only");
}

mx::array greedy_pick(const mx::array& logits, mx::StreamOrDevice s) {
  if (logits.ndim() != 2 || logits.shape(1) == 0 || !is_float_dtype(logits.dtype()))
    throw std::invalid_argument("greedy_pick: logits must be a (rows, vocab) float array");
  auto stream = mx::to_stream(s, mx::Device::cpu);
  return mx::array({logits.shape(0)}, mx::int32, std::make_shared<GreedyPick>(stream),
                   {logits});
}

}  // namespace kvchat
