// Backend-neutral helpers for the kvchat kernels. Placed after metal_backend.h
// or cuda_backend.h, which provide PA_FN, pa_exp, pa_to_float, pa_from_float,
// TG_ARRAY and the Metal builtins the kernel bodies use.
#ifndef KVCHAT_COMMON_H
#define KVCHAT_COMMON_H

// Lanes per simdgroup (Metal) or warp (CUDA): 32 on every supported GPU.
#define PA_SIMD_WIDTH 32

// Online softmax starts from a finite minimum so no -inf arithmetic can
// produce NaN (exp(-inf - -inf)) whatever the fast-math mode.
#define PA_FINITE_MIN (-3.4028234663852886e+38f)

PA_FN float pa_max(float a, float b) {
  return a > b ? a : b;
}

// A lane's slice of one K or V row in fp32 registers. Returned by value: an
// MSL pointer or reference parameter would need an address space, which
// differs between the backends.
template <int N>
struct PaLaneRow {
  float v[N];
};

// One affine-quantized element as mx.dequantize computes it: scale * q is
// rounded to the scales' type S, then + bias is rounded again. Both fp32
// steps are exact or double-round harmlessly (24 >= 2 * 11 + 2 bits), so the
// kernel reads the very values the reference dequantizes to.
template <typename S>
PA_FN float pa_dequantize(uint32_t q, S scale, S bias) {
  const float scaled = pa_to_float(pa_from_float<S>(pa_to_float(scale) * float(q)));
  return pa_to_float(pa_from_float<S>(scaled + pa_to_float(bias)));
}

// Reads lane `lane`'s EPL = D / 32 consecutive dims of pool row `row` (one
// token slot of one KV head). BITS is the side's storage: 0 = plain values
// (D per row, any float type), 4 or 8 = mx.quantize layout: D * BITS / 32
// uint32 words per row, element j of a word at bits [j * BITS, (j + 1) * BITS),
// and one scale and bias per GROUP consecutive dims. Class templates, not
// `if constexpr`, pick the layout: MSL is C++14-based.
template <int BITS, int GROUP, int D>
struct PaRowReader {
  static_assert(BITS == 4 || BITS == 8, "quantized KV is 4- or 8-bit");
  static_assert(D % GROUP == 0 && (D * BITS) % 32 == 0, "rows are whole groups and words");

  // P, SP, BP: pointer types with their address spaces (Metal binds inputs of
  // fewer than 8 elements as constant, others as device).
  template <typename P, typename SP, typename BP>
  static PA_FN PaLaneRow<D / PA_SIMD_WIDTH> read(P pool, SP scales, BP biases, int64_t row,
                                                 int lane) {
    constexpr int EPL = D / PA_SIMD_WIDTH;
    constexpr int PER_WORD = 32 / BITS;
    constexpr uint32_t MASK = (1u << BITS) - 1u;
    const int64_t words = row * (D / PER_WORD);
    const int64_t groups = row * (D / GROUP);
    PaLaneRow<EPL> r;
    for (int i = 0; i < EPL; ++i) {
      // A lane's dims may straddle words and groups (D = 96: EPL = 3), so
      // both indices follow the dim, not the lane.
      const int dim = lane * EPL + i;
      const uint32_t word = pool[words + dim / PER_WORD];
      const int group = dim / GROUP;
      const uint32_t q = (word >> ((dim % PER_WORD) * BITS)) & MASK;
      r.v[i] = pa_dequantize(q, scales[groups + group], biases[groups + group]);
    }
    return r;
  }
};

template <int GROUP, int D>
struct PaRowReader<0, GROUP, D> {
  // Plain rows: the scales and biases inputs are placeholders, never read.
  template <typename P, typename SP, typename BP>
  static PA_FN PaLaneRow<D / PA_SIMD_WIDTH> read(P pool, SP, BP, int64_t row, int lane) {
    constexpr int EPL = D / PA_SIMD_WIDTH;
    const int64_t base = row * D + lane * EPL;
    PaLaneRow<EPL> r;
    for (int i = 0; i < EPL; ++i) {
      r.v[i] = pa_to_float(pool[base + i]);
    }
    return r;
  }
};

#endif  // KVCHAT_COMMON_H
