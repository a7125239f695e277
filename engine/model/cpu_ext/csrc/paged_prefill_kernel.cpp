// Causal prefill attention straight from the block-paged KV pool: the L newest
// positions of each sequence attend over its context, the contract of
// engine/model/attention for L > 1.
//
// Flash-style, never materializing the L x T scores: one task per (sequence,
// KV head, tile of query positions). A tile's rows are every query head of the
// GQA group at each of its positions, so each K/V row is converted to float32
// once per tile and serves all of them. Keys come in blocks of 64: S = Q K^T
// and O += P V are register-blocked (kRows rows x 64 columns of accumulators)
// with an online softmax in between; key blocks past a tile's last position
// are never read and the diagonal block is masked per position. Quantized rows
// (4/8 bits) are dequantized as read, like the decode kernel does.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "paged_decode_kernel.h"
#include "pool.h"

namespace kvchat {

namespace {

constexpr int kKeys = 64;  // keys per block
constexpr int kNV = kKeys / W;  // score vectors per row
constexpr int kTileRows = 96;  // rows (positions x group heads) per task
// Rows per micro-kernel: 6 rows x 4 vectors of accumulators fit AVX-512's 32
// registers; AVX2 and NEON hold a vector in 2 or 4 registers, so half as many.
#if defined(__AVX512F__)
constexpr int kRows = 6;
#else
constexpr int kRows = 2;
#endif
// Below this many multiply-adds (~0.3 ms on one core) one thread does it all:
// waking the second costs 50-300 us on the 2-core build VMs.
constexpr int64_t kParallelMinMacs = int64_t(1) << 23;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// s (kRows x kKeys) = q (kRows x D) . kt (D x kKeys).
inline void scores(const float* q, int D, const float* kt, float* s) {
  vf acc[kRows][kNV];
  for (int r = 0; r < kRows; ++r)
    for (int j = 0; j < kNV; ++j) acc[r][j] = vf{};
  for (int d = 0; d < D; ++d) {
    vf k[kNV];
    for (int j = 0; j < kNV; ++j) k[j] = load(kt + d * kKeys + j * W);
    for (int r = 0; r < kRows; ++r) {
      const vf qs = splat(q[r * D + d]);
      for (int j = 0; j < kNV; ++j) acc[r][j] += qs * k[j];
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int j = 0; j < kNV; ++j) store(s + r * kKeys + j * W, acc[r][j]);
}

// Columns d0 .. d0 + NV * W of o (kRows x D): o * alpha + p (kRows x n) . v (n rows of D).
template <int NV>
inline void accumulate(const float* p, const float* const* v, int n, int D, int d0,
                       const float* alpha, float* o) {
  vf acc[kRows][NV];
  for (int r = 0; r < kRows; ++r)
    for (int j = 0; j < NV; ++j) acc[r][j] = load(o + r * D + d0 + j * W) * alpha[r];
  for (int t = 0; t < n; ++t) {
    vf vv[NV];
    for (int j = 0; j < NV; ++j) vv[j] = load(v[t] + d0 + j * W);
    for (int r = 0; r < kRows; ++r) {
      const vf ps = splat(p[r * kKeys + t]);
      for (int j = 0; j < NV; ++j) acc[r][j] += ps * vv[j];
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int j = 0; j < NV; ++j) store(o + r * D + d0 + j * W, acc[r][j]);
}

void accumulate_rows(const float* p, const float* const* v, int n, int D, const float* alpha,
                     float* o) {
  int d0 = 0;
  for (; d0 + 4 * W <= D; d0 += 4 * W) accumulate<4>(p, v, n, D, d0, alpha, o);
  switch ((D - d0) / W) {
    case 3:
      accumulate<3>(p, v, n, D, d0, alpha, o);
      break;
    case 2:
      accumulate<2>(p, v, n, D, d0, alpha, o);
      break;
    case 1:
      accumulate<1>(p, v, n, D, d0, alpha, o);
      break;
  }
}

// Scores of one row -> probabilities in place (keys lo .. lim - 1 are visible,
// the rest become 0); updates the row's running max and sum and returns the
// factor its accumulated output must be scaled by.
inline float softmax_row(float* s, int lo, int lim, float& m, float& l) {
  vi lane;
  for (int i = 0; i < W; ++i) lane[i] = i;
  vf sv[kNV];
  vf top = splat(kNegInf);
  for (int j = 0; j < kNV; ++j) {
    const vi visible = (lane + j * W < lim) & (lane + j * W >= lo);
    sv[j] = visible ? load(s + j * W) : splat(kNegInf);
    top = top > sv[j] ? top : sv[j];
  }
  const float m_new = std::max(m, hmax(top));
  const float alpha = std::exp(m - m_new);  // 0 on the first block (m = -inf)
  vf sum{};
  for (int j = 0; j < kNV; ++j) {
    const vi visible = (lane + j * W < lim) & (lane + j * W >= lo);
    const vf e = visible ? exp_neg(sv[j] - m_new) : vf{};
    store(s + j * W, e);
    sum += e;
  }
  m = m_new;
  l = l * alpha + hsum(sum);
  return alpha;
}

struct TileBuffers {
  std::vector<float> data;
  float *q, *o, *s, *k, *kt, *v, *zero, *m, *l, *alpha;
  const float* krow[kKeys];  // each key's K and V row (pool or k / v below)
  const float* vrow[kKeys];

  TileBuffers(int rows, int D) {
    data.resize(size_t(rows) * (2 * D + kKeys + 3) + size_t(kKeys) * 3 * D + size_t(D));
    q = data.data();
    o = q + size_t(rows) * D;
    s = o + size_t(rows) * D;
    m = s + size_t(rows) * kKeys;
    l = m + rows;
    alpha = l + rows;
    k = alpha + rows;
    kt = k + size_t(kKeys) * D;
    v = kt + size_t(kKeys) * D;
    zero = v + size_t(kKeys) * D;  // D zeros (data is zeroed)
  }
};

// Query positions p0 .. p1 of sequence b, KV head h, into out (B, Hq, L, D).
void attend_tile(const Problem& pb, int b, int h, int p0, int p1, float* out) {
  const int D = pb.D, L = pb.L, G = pb.Hq / pb.Hkv;
  const int rows = (p1 - p0) * G;
  const int padded = (rows + kRows - 1) / kRows * kRows;
  const int first = pb.lens[b] - L;  // position of query 0
  TileBuffers t(padded, D);
  // Row r is head h * G + r % G at position p0 + r / G; padding rows see no key.
  auto head_row = [&](int r) {
    return (int64_t(b) * pb.Hq + h * G + r % G) * L + p0 + r / G;
  };
  for (int r = 0; r < padded; ++r) {
    float* q = t.q + size_t(r) * D;
    if (r >= rows) {
      std::fill(q, q + D, 0.0f);
    } else if (pb.k.bits == 4) {
      permute4(pb.q + head_row(r) * D, q, D);
    } else {
      std::copy_n(pb.q + head_row(r) * D, D, q);
    }
    for (int d = 0; d < D; ++d) q[d] *= pb.scale;
    std::fill(t.o + size_t(r) * D, t.o + size_t(r + 1) * D, 0.0f);
    t.m[r] = kNegInf;
    t.l[r] = 0.0f;
  }
  auto visible = [&](int r, int k0, int nk) {  // keys of this block row r sees: [.., lim)
    return r >= rows ? 0 : std::min(nk, first + p0 + r / G - k0 + 1);
  };
  auto hidden = [&](int r, int k0) {  // ... from this one on: a window hides the earlier
    return r >= rows ? 0 : std::max(0, pb.first_key(first + p0 + r / G) - k0);
  };
  bool bad = false;  // an id outside the pool: report NaN, never read it
  const int end = first + p1;  // keys 0 .. end - 1 are visible to some row
  // A window hides every key before the first row's first one from every row.
  for (int k0 = pb.first_key(first + p0); k0 < end && !bad; k0 += kKeys) {
    const int nk = std::min(kKeys, end - k0);
    // Each key's K and V row: float32 rows straight from the pool, others converted into
    // the tile's buffers (keys past nk: a zero row, never used).
    for (int i = 0; i < kKeys; ++i) {
      const int key = k0 + i;
      const int64_t row0 = i < nk ? block_row0(pb, b, h, key / pb.BS) : 0;
      if (row0 < 0) {
        bad = true;
        break;
      }
      if (i >= nk) {
        t.krow[i] = t.vrow[i] = t.zero;
        continue;
      }
      const int64_t row = row0 + key % pb.BS;
      t.krow[i] = pb.k.row(row, t.k + size_t(i) * D);
      t.vrow[i] = pb.v.row(row, t.v + size_t(i) * D);
    }
    if (bad) break;
    // K^T, 16 x 16 blocks transposed in registers.
    for (int k16 = 0; k16 < nk; k16 += W)
      for (int d16 = 0; d16 < D; d16 += W) {
        vf block[W];
        for (int i = 0; i < W; ++i) block[i] = load(t.krow[k16 + i] + d16);
        transpose16(block);
        for (int i = 0; i < W; ++i) store(t.kt + (d16 + i) * kKeys + k16, block[i]);
      }
    for (int r0 = 0; r0 < padded; r0 += kRows) {
      int n = 0;  // keys any row of this group sees
      for (int r = r0; r < r0 + kRows; ++r) n = std::max(n, visible(r, k0, nk));
      if (n <= 0) continue;
      float* s = t.s + size_t(r0) * kKeys;
      scores(t.q + size_t(r0) * D, D, t.kt, s);
      for (int r = r0; r < r0 + kRows; ++r) {
        const int lim = visible(r, k0, nk), lo = hidden(r, k0);
        float* sr = t.s + size_t(r) * kKeys;
        if (lim > lo) {
          t.alpha[r] = softmax_row(sr, lo, lim, t.m[r], t.l[r]);
        } else {  // this row sees none of the block: adds nothing
          std::fill_n(sr, kKeys, 0.0f);
          t.alpha[r] = 1.0f;
        }
      }
      accumulate_rows(s, t.vrow, n, D, t.alpha + r0, t.o + size_t(r0) * D);
    }
  }
  for (int r = 0; r < rows; ++r) {
    // A sink adds exp(sink - m) to the denominator (o and l are relative to m).
    const float l = t.l[r] + pb.sink_weight(h * G + r % G, t.m[r]);
    const float inv = bad ? std::numeric_limits<float>::quiet_NaN() : 1.0f / l;
    float* o = t.o + size_t(r) * D;
    for (int d = 0; d < D; ++d) o[d] *= inv;
    float* dst = out + head_row(r) * D;
    if (pb.v.bits == 4)
      unpermute4(o, dst, D);
    else
      std::copy_n(o, D, dst);
  }
}

}  // namespace

void run_prefill(const Problem& pb, float* out) {
  const int G = pb.Hq / pb.Hkv;
  const int positions = std::max(1, kTileRows / G);
  const int tiles = (pb.L + positions - 1) / positions;
  int64_t macs = 0;
  for (int b = 0; b < pb.B; ++b) macs += int64_t(pb.L) * pb.lens[b] * pb.Hq * pb.D;
  auto& pool = ThreadPool::instance();
  const int units = pb.B * pb.Hkv;
  // The last tiles see the most keys: they go first, so the tasks left at the
  // end are short and the threads finish together.
  auto body = [&](int task) {
    const int tile = tiles - 1 - task / units, unit = task % units;
    const int p0 = tile * positions;
    attend_tile(pb, unit / pb.Hkv, unit % pb.Hkv, p0, std::min(pb.L, p0 + positions), out);
  };
  if (macs >= kParallelMinMacs && pool.size() > 1) {
    pool.run(tiles * units, body);
  } else {
    for (int task = 0; task < tiles * units; ++task) body(task);
  }
}

}  // namespace kvchat
