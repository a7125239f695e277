// Portable 16-lane float vectors (GCC/Clang vector extensions) and the few
// conversions the kernels need. Built with -march=native on the machine that
// runs it: AVX-512 uses one register per vector, AVX2 two, NEON four.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#elif defined(__aarch64__)
#include <arm_neon.h>
#endif

namespace kvchat {

constexpr int W = 16;  // lanes per vector
typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
typedef uint32_t vu __attribute__((vector_size(64)));
typedef uint8_t vb __attribute__((vector_size(16)));
typedef uint16_t vh __attribute__((vector_size(32)));

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store(float* p, vf v) {
  std::memcpy(p, &v, sizeof(v));
}

// Not `vf{} + x`: that is an add (0 + -0 is +0) and then a register shuffle,
// two extra uops on the FMA ports; this is one broadcast, from memory when x is.
inline vf splat(float x) {
  return vf{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x};
}

inline float hsum(vf v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps(reinterpret_cast<__m512>(v));
#elif defined(__AVX__)
  __m256 a, b;
  std::memcpy(&a, &v, 32);
  std::memcpy(&b, reinterpret_cast<const char*>(&v) + 32, 32);
  const __m256 s8 = _mm256_add_ps(a, b);
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  s4 = _mm_add_ss(s4, _mm_shuffle_ps(s4, s4, 1));
  return _mm_cvtss_f32(s4);
#else
  float s = 0.0f;  // (no __builtin_shufflevector before GCC 12)
  for (int i = 0; i < W; ++i) s += v[i];
  return s;
#endif
}

inline float hmax(vf v) {
  float m = v[0];
  for (int i = 1; i < W; ++i) m = v[i] > m ? v[i] : m;
  return m;
}

// 16 bytes -> 16 floats (unsigned). GCC's generic conversion of this shape
// inserts lane by lane, so each ISA gets its widening instructions.
inline vf bytes_to_float(vb b) {
#if defined(__AVX512F__)
  return reinterpret_cast<vf>(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32((__m128i)b)));
#elif defined(__AVX2__)
  const __m128i raw = (__m128i)b;
  const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(raw));
  const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(raw, raw)));
  vf v;
  std::memcpy(&v, &lo, 32);
  std::memcpy(reinterpret_cast<char*>(&v) + 32, &hi, 32);
  return v;
#elif defined(__aarch64__)
  const uint8x16_t raw = (uint8x16_t)b;
  const uint16x8_t lo = vmovl_u8(vget_low_u8(raw)), hi = vmovl_u8(vget_high_u8(raw));
  const float32x4_t parts[4] = {vcvtq_f32_u32(vmovl_u16(vget_low_u16(lo))),
                                vcvtq_f32_u32(vmovl_u16(vget_high_u16(lo))),
                                vcvtq_f32_u32(vmovl_u16(vget_low_u16(hi))),
                                vcvtq_f32_u32(vmovl_u16(vget_high_u16(hi)))};
  vf v;
  std::memcpy(&v, parts, sizeof(v));
  return v;
#else
  vf v;
  for (int i = 0; i < W; ++i) v[i] = float(b[i]);
  return v;
#endif
}

// Bytes of lo and hi interleaved (lo0 hi0 lo1 hi1 ...): first holds the first
// 16 of the 32, second the rest.
inline void interleave(vb lo, vb hi, vb& first, vb& second) {
#if defined(__SSE2__)
  first = (vb)_mm_unpacklo_epi8((__m128i)lo, (__m128i)hi);
  second = (vb)_mm_unpackhi_epi8((__m128i)lo, (__m128i)hi);
#elif defined(__aarch64__)
  first = (vb)vzip1q_u8((uint8x16_t)lo, (uint8x16_t)hi);
  second = (vb)vzip2q_u8((uint8x16_t)lo, (uint8x16_t)hi);
#else
  for (int i = 0; i < 8; ++i) {
    first[2 * i] = lo[i];
    first[2 * i + 1] = hi[i];
    second[2 * i] = lo[8 + i];
    second[2 * i + 1] = hi[8 + i];
  }
#endif
}

// v[i] <- column i of the 16 x 16 matrix whose rows are v[0..15].
__attribute__((always_inline)) inline void transpose16(vf* v) {
#if defined(__AVX512F__)
  __m512 r[W], t[W];
  std::memcpy(r, v, sizeof(r));
  for (int i = 0; i < W; i += 2) {  // 2 x 2 blocks
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < W; i += 4) {  // 4 x 4 blocks
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {  // 128-bit lanes across 4 and then 8 rows
    t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
  }
  std::memcpy(v, r, sizeof(r));
#else
  float m[W][W];
  std::memcpy(m, v, sizeof(m));
  for (int i = 0; i < W; ++i)
    for (int j = 0; j < W; ++j) v[i][j] = m[j][i];
#endif
}

// The low and high nibbles of 16 bytes (x86 has no 8-bit vector shift).
inline void nibbles(vb raw, vb& lo, vb& hi) {
  lo = raw & 0x0f;
#if defined(__SSE2__)
  hi = (vb)_mm_srli_epi16((__m128i)raw, 4) & 0x0f;
#else
  hi = raw >> 4;
#endif
}

// IEEE half -> float by bit manipulation (the portable path; handles
// subnormals, inf and nan).
inline float half_bits_to_float(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t mant = h & 0x3ff;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {  // subnormal: renormalize
    int e = -1;
    do {
      mant <<= 1;
      ++e;
    } while (!(mant & 0x400));
    bits = sign | uint32_t(112 - e) << 23 | ((mant & 0x3ff) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Element types of the arrays we read: float32, IEEE half and bfloat16
// (both carried as raw 16-bit patterns).
enum class Elem { f32, f16, bf16 };

inline vf load_f16(const uint16_t* p) {
#if defined(__AVX512F__)
  return reinterpret_cast<vf>(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)));
#elif defined(__F16C__)
  __m256 a = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
  __m256 b = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 8)));
  vf v;
  std::memcpy(&v, &a, 32);
  std::memcpy(reinterpret_cast<char*>(&v) + 32, &b, 32);
  return v;
#elif defined(__aarch64__)
  vf v;
  const __fp16* q = reinterpret_cast<const __fp16*>(p);
  for (int i = 0; i < W; ++i) v[i] = float(q[i]);
  return v;
#else
  vf v;
  for (int i = 0; i < W; ++i) v[i] = half_bits_to_float(p[i]);
  return v;
#endif
}

inline vf load_bf16(const uint16_t* p) {
  vh h;
  std::memcpy(&h, p, sizeof(h));
  vu bits = __builtin_convertvector(h, vu) << 16;
  return reinterpret_cast<vf>(bits);
}

// 16 values of element type `e` starting at element `i` of `base` -> floats.
inline vf load_any(const void* base, Elem e, int64_t i) {
  switch (e) {
    case Elem::f32:
      return load(static_cast<const float*>(base) + i);
    case Elem::f16:
      return load_f16(static_cast<const uint16_t*>(base) + i);
    default:
      return load_bf16(static_cast<const uint16_t*>(base) + i);
  }
}

inline float scalar_any(const void* base, Elem e, int64_t i) {
  switch (e) {
    case Elem::f32:
      return static_cast<const float*>(base)[i];
    case Elem::f16: {
#if defined(__F16C__)
      return _cvtsh_ss(static_cast<const uint16_t*>(base)[i]);
#else
      return half_bits_to_float(static_cast<const uint16_t*>(base)[i]);
#endif
    }
    default: {
      uint32_t bits = uint32_t(static_cast<const uint16_t*>(base)[i]) << 16;
      float f;
      std::memcpy(&f, &bits, 4);
      return f;
    }
  }
}

// Convert n floats to `e` (round to nearest even) at dst.
void store_any(void* dst, Elem e, const float* src, int64_t n);

// exp(x) for x <= 0 (softmax after subtracting the max): Cody-Waite range
// reduction and a degree-6 polynomial, ~2 ulp; x < -87 flushes towards 0.
inline vf exp_neg(vf x) {
  const vf lo = splat(-87.0f);
  x = x < lo ? lo : x;
  vf n = x * 1.44269504088896341f;
  n = __builtin_convertvector(__builtin_convertvector(n + (n < 0 ? -0.5f : 0.5f), vi), vf);
  vf r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  vf p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  vi e = (__builtin_convertvector(n, vi) + 127) << 23;
  return p * reinterpret_cast<vf>(e);
}

}  // namespace kvchat
