// Prefill over a residual-format pool (paged_residual.h): the L newest positions of each
// sequence attend causally by the rule, the blocks before a query's own quantized and its
// own block exact.
//
// Per sequence, the blocks its chunk reads are laid out once as float32 rows: the
// quantized ones (from the window's first block up to the chunk's last) dequantized from
// their stored codes, then the chunk's own blocks exact from the side store. Each block of
// the chunk becomes one row of a batch for the flash prefill kernel (run_prefill) whose
// table names the quantized blocks before it and its own exact one, so each query reads
// what the rule says and its result depends on its position only, never on how the prompt
// was cut (a cached prompt's tail equals a cold prefill's rows).
//
// Everything stays in the stored spaces: quantized rows are not rotated back. Keys live
// in the key space (times R when rotate_k: the exact keys are rotated, the queries too,
// and (q R) . (k R) = q . k); values in the stored value space (times R, 4-bit element
// order: `stored_space`), the output mapped back per row. The rows moved are a chunk's
// exact rows and its outputs, not the context's.
#include <algorithm>
#include <atomic>
#include <limits>
#include <utility>
#include <vector>

#include "kernels.h"
#include "paged_residual_kernel.h"
#include "pool.h"

namespace kvchat {

namespace {

constexpr int64_t kParallelMinElements = 1 << 16;  // K/V elements laid out
constexpr size_t kKeepBytes = size_t(32) << 20;

// The laid-out rows, padded queries and outputs, kept by the calling thread (MLX's CPU
// stream, which runs every layer of every chunk) up to kKeepBytes: fresh pages each call
// cost more than the layout itself (1k of context, a 512-token chunk: layout 1.0 -> 0.15
// ms, the queries' copy 0.56 -> 0.08 ms).
struct Scratch {
  std::vector<float> k, v, q, o;

  float* take(std::vector<float>& buf, size_t n) {
    if (buf.size() < n) buf.resize(n);
    return buf.data();
  }
  void trim() {
    const size_t bytes = (k.size() + v.size() + q.size() + o.size()) * sizeof(float);
    if (bytes > kKeepBytes)
      for (auto* buf : {&k, &v, &q, &o}) std::vector<float>().swap(*buf);
  }
};

Scratch& scratch() {
  thread_local Scratch s;
  return s;
}

// The rows one sequence's chunk reads: (Hkv, blocks, BS, D) a side, float32.
struct ChunkRows {
  int w0, first, last;  // a window's first block; the chunk's first and last block
  int quantized() const { return last - w0; }  // blocks w0 .. last - 1
  int blocks() const { return quantized() + last - first + 1; }
};

// Quantized block `phys` of KV head h into k and v (BS x D each): keys from their
// per-channel codes (16 channels x 16 tokens, transposed into rows), values per token.
void lay_out_quantized(const ResidualProblem& pb, int h, int32_t phys, float* k, float* v) {
  const int D = pb.D, BS = pb.BS;
  const int64_t id = int64_t(h) * pb.num_blocks + phys;
  const uint8_t* codes = pb.k_codes + id * D * pb.k_width;
  for (int d0 = 0; d0 < D; d0 += W)
    for (int c = 0; c < BS / W; ++c) {
      vf cols[W];  // channel d0 + i over tokens 16c .. 16c + 15
      for (int i = 0; i < W; ++i) {
        const int64_t param = id * D + d0 + i;
        cols[i] = channel_codes(codes + int64_t(d0 + i) * pb.k_width, pb.k_bits, c) *
                      splat(scalar_any(pb.k_scales, pb.k_elem, param)) +
                  splat(scalar_any(pb.k_biases, pb.k_elem, param));
      }
      transpose16(cols);  // now token 16c + i over channels d0 ..
      for (int i = 0; i < W; ++i) store(k + int64_t(c * W + i) * D + d0, cols[i]);
    }
  for (int t = 0; t < BS; ++t) {
    float* row = v + int64_t(t) * D;
    const float* got = pb.v.row(id * BS + t, row);
    if (got != row) std::copy_n(got, D, row);
  }
}

// Residual row `res` of KV head h into k and v in the stored spaces.
void lay_out_exact(const ResidualProblem& pb, int h, int32_t res, float* k, float* v,
                   float* tmp) {
  const int D = pb.D;
  float* plain = tmp + D;
  float* moved = plain + D;
  for (int t = 0; t < pb.BS; ++t) {
    const int64_t row = ((int64_t(h) * pb.nres + res) * pb.BS + t) * D;
    float* kr = k + int64_t(t) * D;
    for (int d = 0; d < D; d += W) store(pb.rotate_k ? plain + d : kr + d,
                                         load_any(pb.res_k, pb.res_elem, row + d));
    if (pb.rotate_k) hadamard_row(plain, kr, D, pb.signs, false);
    for (int d = 0; d < D; d += W) store(plain + d, load_any(pb.res_v, pb.res_elem, row + d));
    std::copy_n(stored_space(pb, plain, tmp, moved), D, v + int64_t(t) * D);
  }
}

// Sequence b's rows into k and v; false when a block id lies outside the pool or the side
// store (never read: the caller reports NaN).
bool lay_out(const ResidualProblem& pb, int b, const ChunkRows& c, float* k, float* v) {
  const int nq = c.quantized(), n = c.blocks();
  const int64_t block = int64_t(pb.BS) * pb.D, side = int64_t(n) * block;
  std::atomic<bool> ok{true};
  auto body = [&](int task) {
    const int h = task / n, j = task % n;
    const int blk = j < nq ? c.w0 + j : c.first + j - nq;
    const int32_t phys = pb.tables[int64_t(b) * pb.table_width + blk];
    float* kb = k + h * side + j * block;
    float* vb = v + h * side + j * block;
    // a chunk's block is exact where the side store holds it, else (a full block whose
    // positions only padding queries of a batched call take) quantized, as decode reads it
    const int32_t res = phys < 0 || phys >= pb.num_blocks || j < nq ? -1 : pb.res_map[phys];
    if (phys < 0 || phys >= pb.num_blocks || res >= pb.nres) {
      ok = false;
    } else if (res < 0) {
      lay_out_quantized(pb, h, phys, kb, vb);
    } else {
      std::vector<float> tmp(3 * size_t(pb.D));
      lay_out_exact(pb, h, res, kb, vb, tmp.data());
    }
  };
  auto& pool = ThreadPool::instance();
  const int tasks = pb.Hkv * n;
  if (2 * side * pb.Hkv >= kParallelMinElements && pool.size() > 1)
    pool.run(tasks, body);
  else
    for (int t = 0; t < tasks; ++t) body(t);
  return ok;
}

// Sequence b's L queries (q: (Hq, L, D) in the key space, scaled) into out (Hq, L, D).
void prefill_sequence(const ResidualProblem& pb, int b, int L, const float* q, float* out) {
  const int BS = pb.BS, D = pb.D, Hq = pb.Hq, n = pb.lens[b];
  ChunkRows c{};
  c.first = (n - L) / BS;
  c.last = (n - 1) / BS;
  // a window hides the blocks before the first query's first key from every query
  c.w0 = pb.window > 0 ? std::max(0, n - L - pb.window + 1) / BS : 0;
  const int span = c.last - c.first + 1, nq = c.quantized();
  const size_t side = size_t(pb.Hkv) * c.blocks() * BS * D;
  const size_t rows = size_t(span) * Hq * BS * D;
  Scratch& sc = scratch();
  float* k = sc.take(sc.k, side);
  float* v = sc.take(sc.v, side);
  float* qs = sc.take(sc.q, rows);
  float* os = sc.take(sc.o, rows);
  if (!lay_out(pb, b, c, k, v)) {
    std::fill_n(out, int64_t(Hq) * L * D, std::numeric_limits<float>::quiet_NaN());
    return;
  }
  // Batch row j: the chunk's block first + j, its queries at its slots (the rest zero,
  // dropped), its table the quantized blocks before it (ids from 0) and itself exact.
  const int width = c.last + 1;
  std::vector<int32_t> tables(size_t(span) * width, 0), lens(span);
  const int front = n - L - c.first * BS;  // slot of query 0 in the first block
  for (int j = 0; j < span; ++j) {
    int32_t* row = tables.data() + size_t(j) * width;
    for (int i = c.w0; i < c.first + j; ++i) row[i] = i - c.w0;
    row[c.first + j] = nq + j;
    lens[j] = (c.first + j + 1) * BS;
  }
  auto slot = [&](int j, int hq, int s) { return ((int64_t(j) * Hq + hq) * BS + s) * D; };
  for (int hq = 0; hq < Hq; ++hq) {
    // the first block's slots before the chunk and the last's after it: zero queries
    std::fill_n(qs + slot(0, hq, 0), int64_t(front) * D, 0.0f);
    const int end = (front + L - 1) % BS + 1;
    std::fill_n(qs + slot(span - 1, hq, end), int64_t(BS - end) * D, 0.0f);
    for (int p = 0; p < L; ++p)
      std::copy_n(q + (int64_t(hq) * L + p) * D, D,
                  qs + slot((front + p) / BS, hq, (front + p) % BS));
  }
  Problem fp{};
  fp.q = qs;
  for (auto [sd, laid] : {std::pair{&fp.k, k}, std::pair{&fp.v, v}}) {
    sd->data = reinterpret_cast<const char*>(laid);
    sd->elem = Elem::f32;
    sd->D = D;
  }
  fp.tables = tables.data();
  fp.table_width = width;
  fp.lens = lens.data();
  fp.B = span;
  fp.Hq = Hq;
  fp.Hkv = pb.Hkv;
  fp.D = D;
  fp.BS = BS;
  fp.num_blocks = c.blocks();
  fp.L = BS;
  fp.scale = 1.0f;  // the queries come scaled
  fp.window = pb.window;
  fp.sinks = pb.sinks;
  run_prefill(fp, os);
  std::vector<float> row(D);
  for (int hq = 0; hq < Hq; ++hq)
    for (int p = 0; p < L; ++p)
      plain_space(pb, os + slot((front + p) / BS, hq, (front + p) % BS), row.data(),
                  out + (int64_t(hq) * L + p) * D);
}

}  // namespace

void run_residual_prefill(const ResidualProblem& pb, int L, float* out) {
  const int64_t per = int64_t(pb.Hq) * L * pb.D;
  for (int b = 0; b < pb.B; ++b) prefill_sequence(pb, b, L, pb.qk + b * per, out + b * per);
  scratch().trim();
}

}  // namespace kvchat
