// Enough of the Metal Shading Language (plus what MLX's utils.h prepends) to
// compile the source that mx.fast.metal_kernel generates as C++20 on the CPU.
// Force-included before the generated text; msl_shim_end.h undoes the macros.
#pragma once

#include <bit>
#include <cmath>
#include <limits>
#include <type_traits>

#include "shim_runtime.h"

namespace metal {

// ---- scalar types -----------------------------------------------------------
typedef _Float16 half;
typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;

typedef shim::bf16 bfloat;

// ---- vectors ----------------------------------------------------------------
template <typename T, int N>
struct vec;
template <typename T>
struct vec<T, 2> {
  T x{}, y{};
  T& operator[](int i) { return (&x)[i]; }
  T operator[](int i) const { return (&x)[i]; }
};
template <typename T>
struct vec<T, 3> {
  T x{}, y{}, z{};
  T& operator[](int i) { return (&x)[i]; }
  T operator[](int i) const { return (&x)[i]; }
};
template <typename T>
struct vec<T, 4> {
  T x{}, y{}, z{}, w{};
  T& operator[](int i) { return (&x)[i]; }
  T operator[](int i) const { return (&x)[i]; }
};
#define SHIM_VEC_OP(op)                                                   \
  template <typename T, int N>                                            \
  vec<T, N> operator op(vec<T, N> a, const vec<T, N>& b) {                \
    for (int i = 0; i < N; ++i) a[i] = a[i] op b[i];                      \
    return a;                                                             \
  }                                                                       \
  template <typename T, int N>                                            \
  vec<T, N> operator op(vec<T, N> a, T b) {                               \
    for (int i = 0; i < N; ++i) a[i] = a[i] op b;                         \
    return a;                                                             \
  }
SHIM_VEC_OP(+)
SHIM_VEC_OP(-)
SHIM_VEC_OP(*)
SHIM_VEC_OP(/)
#undef SHIM_VEC_OP
template <typename T, int N>
T dot(const vec<T, N>& a, const vec<T, N>& b) {
  T s{};
  for (int i = 0; i < N; ++i) s += a[i] * b[i];
  return s;
}
#define SHIM_VEC_TYPES(T)    \
  typedef vec<T, 2> T##2;    \
  typedef vec<T, 3> T##3;    \
  typedef vec<T, 4> T##4;
SHIM_VEC_TYPES(float)
SHIM_VEC_TYPES(half)
SHIM_VEC_TYPES(int)
SHIM_VEC_TYPES(uint)
SHIM_VEC_TYPES(short)
SHIM_VEC_TYPES(ushort)
#undef SHIM_VEC_TYPES

// ---- math -------------------------------------------------------------------
inline float exp(float x) { return std::exp(x); }
inline float exp2(float x) { return std::exp2(x); }
inline float log(float x) { return std::log(x); }
inline float sqrt(float x) { return std::sqrt(x); }
inline float rsqrt(float x) { return 1.0f / std::sqrt(x); }
inline float abs(float x) { return std::fabs(x); }
inline float fma(float a, float b, float c) { return std::fma(a, b, c); }
inline float max(float a, float b) { return std::fmax(a, b); }
inline float min(float a, float b) { return std::fmin(a, b); }
inline int max(int a, int b) { return a > b ? a : b; }
inline int min(int a, int b) { return a < b ? a : b; }
inline uint max(uint a, uint b) { return a > b ? a : b; }
inline uint min(uint a, uint b) { return a < b ? a : b; }
inline float clamp(float x, float lo, float hi) { return min(max(x, lo), hi); }
inline bool isfinite(float x) { return std::isfinite(x); }
inline bool isnan(float x) { return std::isnan(x); }
inline bool isinf(float x) { return std::isinf(x); }
template <typename T>
T select(T a, T b, bool c) { return c ? b : a; }
template <typename To, typename From>
To as_type(From x) { return std::bit_cast<To>(x); }
namespace fast {
inline float exp(float x) { return std::exp(x); }
inline float exp2(float x) { return std::exp2(x); }
inline float rsqrt(float x) { return 1.0f / std::sqrt(x); }
}  // namespace fast
namespace precise {
inline float exp(float x) { return std::exp(x); }
inline float exp2(float x) { return std::exp2(x); }
}  // namespace precise
using std::numeric_limits;

// ---- synchronisation and SIMD-group functions --------------------------------
enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
inline mem_flags operator|(mem_flags a, mem_flags b) { return mem_flags(int(a) | int(b)); }

using SrcLoc = std::source_location;

// Only flags that include mem_threadgroup order threadgroup memory (the
// checked TG_ARRAY below fails a read that relies on anything else).
inline bool orders_tg(mem_flags f) {
  return (int(f) & int(mem_flags::mem_threadgroup)) != 0;
}
inline void threadgroup_barrier(mem_flags f, const SrcLoc& loc = SrcLoc::current()) {
  shim::group_barrier("threadgroup_barrier", loc, orders_tg(f));
}
inline void simdgroup_barrier(mem_flags f, const SrcLoc& loc = SrcLoc::current()) {
  shim::simd_sync("simdgroup_barrier", loc, orders_tg(f));
}

template <typename T>
T simd_sum(T x, const SrcLoc& loc = SrcLoc::current()) {
  return shim::simd_exchange(x, "simd_sum", loc, [](auto slot, int n, int) {
    // Pairwise tree order, like the hardware's butterfly.
    T v[shim::kSimdWidth];
    for (int i = 0; i < n; ++i) v[i] = slot(i);
    for (int w = 1; w < n; w *= 2)
      for (int i = 0; i + w < n; i += 2 * w) v[i] = v[i] + v[i + w];
    return v[0];
  });
}
template <typename T>
T simd_max(T x, const SrcLoc& loc = SrcLoc::current()) {
  return shim::simd_exchange(x, "simd_max", loc, [](auto slot, int n, int) {
    T r = slot(0);
    for (int i = 1; i < n; ++i) r = slot(i) > r ? slot(i) : r;
    return r;
  });
}
template <typename T>
T simd_min(T x, const SrcLoc& loc = SrcLoc::current()) {
  return shim::simd_exchange(x, "simd_min", loc, [](auto slot, int n, int) {
    T r = slot(0);
    for (int i = 1; i < n; ++i) r = slot(i) < r ? slot(i) : r;
    return r;
  });
}
template <typename T>
T simd_prefix_exclusive_sum(T x, const SrcLoc& loc = SrcLoc::current()) {
  return shim::simd_exchange(x, "simd_prefix_exclusive_sum", loc, [](auto slot, int, int lane) {
    T r{};
    for (int i = 0; i < lane; ++i) r = r + slot(i);
    return r;
  });
}
template <typename T>
T simd_shuffle(T x, ushort src, const SrcLoc& loc = SrcLoc::current()) {
  return shim::simd_exchange(x, "simd_shuffle", loc, [src](auto slot, int n, int lane) {
    return int(src) < n ? slot(src) : slot(lane);
  });
}
template <typename T>
T simd_broadcast(T x, ushort src, const SrcLoc& loc = SrcLoc::current()) {
  return simd_shuffle(x, src, loc);
}
template <typename T>
T simd_shuffle_xor(T x, ushort mask, const SrcLoc& loc = SrcLoc::current()) {
  return shim::simd_exchange(x, "simd_shuffle_xor", loc, [mask](auto slot, int n, int lane) {
    const int src = lane ^ int(mask);
    return src < n ? slot(src) : slot(lane);
  });
}
template <typename T>
T simd_shuffle_down(T x, ushort delta, const SrcLoc& loc = SrcLoc::current()) {
  // Lanes whose source is past the simdgroup keep their own value (MSL spec).
  return shim::simd_exchange(x, "simd_shuffle_down", loc, [delta](auto slot, int n, int lane) {
    const int src = lane + int(delta);
    return src < n ? slot(src) : slot(lane);
  });
}
template <typename T>
T simd_shuffle_up(T x, ushort delta, const SrcLoc& loc = SrcLoc::current()) {
  return shim::simd_exchange(x, "simd_shuffle_up", loc, [delta](auto slot, int, int lane) {
    const int src = lane - int(delta);
    return src >= 0 ? slot(src) : slot(lane);
  });
}

// ---- thread attributes (what the generated signature receives) ---------------
namespace attr {
inline uint3 u3(const shim::Dim3& d) { return uint3{d.x, d.y, d.z}; }
inline uint3 thread_position_in_grid() {
  auto& c = shim::ctx();
  return uint3{c.group_pos.x * c.group_threads.x + c.local_pos.x,
               c.group_pos.y * c.group_threads.y + c.local_pos.y,
               c.group_pos.z * c.group_threads.z + c.local_pos.z};
}
inline uint3 thread_position_in_threadgroup() { return u3(shim::ctx().local_pos); }
inline uint3 threadgroup_position_in_grid() { return u3(shim::ctx().group_pos); }
inline uint3 threads_per_threadgroup() { return u3(shim::ctx().group_threads); }
inline uint3 threadgroups_per_grid() { return u3(shim::ctx().groups); }
inline uint3 threads_per_grid() { return u3(shim::ctx().grid_threads); }
inline uint thread_index_in_threadgroup() { return shim::ctx().local_index; }
inline uint thread_index_in_simdgroup() { return shim::ctx().lane; }
inline uint simdgroup_index_in_threadgroup() { return shim::ctx().simdgroup; }
inline uint simdgroups_per_threadgroup() { return shim::ctx().num_simdgroups; }
inline uint threads_per_simdgroup() { return shim::kSimdWidth; }
inline uint thread_execution_width() { return shim::kSimdWidth; }
}  // namespace attr

}  // namespace metal

using namespace metal;

// What MLX's utils.h provides to generated kernels (semantics, not its code).
typedef half float16_t;
typedef bfloat bfloat16_t;
template <typename T>
struct Limits {
  static constexpr T max = std::numeric_limits<T>::max();
  static constexpr T min = std::numeric_limits<T>::lowest();
  static constexpr T finite_max = std::numeric_limits<T>::max();
  static constexpr T finite_min = std::numeric_limits<T>::lowest();
};

// Threadgroup arrays: process-wide storage shared by the lane threads (one
// threadgroup runs at a time), registered for poisoning and size accounting,
// every access checked against the memory model (shim::TgArray). With
// SHIM_REAL_TG_ARRAY the kernel's own definition (metal_backend.h:
// `threadgroup T name[N]`, i.e. a static array here) is compiled instead,
// unchecked: ThreadSanitizer is the witness there.
#ifndef SHIM_REAL_TG_ARRAY
#define TG_ARRAY(type, name, count) static ::shim::TgArray<type, (count)> name(#name)
#endif

// Address spaces and function qualifiers: no meaning on the CPU.
#define device
#define constant
#define thread
#define threadgroup static
#define kernel
