// What the int8-activation tiled kernels share (qmm_tiled_int8.cpp: x quantized, the rows
// kernel; qmm_tiled_int8_lanes.cpp: the lanes kernel). Built only with AVX-512 VNNI.
#pragma once

#include <cmath>
#include <vector>

#include "qmm_tiled_impl.h"

namespace kvchat::tiled {

// x quantized to int8 per group: values; per group the step (max |x| / 127), the int8 sum
// and the quantized x's sum (step x int8 sum).
struct QuantX8 {
  std::vector<int8_t> q;  // M x K
  std::vector<float> scale, sum;  // M x G
  std::vector<int32_t> qsum;  // M x G
};

// The float part, the same in both kernels: acc += s * dx * isum (+ b * xsum: IB false).
template <bool IB>
inline __m512 finish(__m512 acc, __m512i isum, __m512 s_dx, __m512 b, __m512 xsum) {
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), s_dx, acc);
  return IB ? acc : _mm512_fmadd_ps(b, xsum, acc);
}

// A symmetric format's integral bias factor (biases = factor x scales), else 0: the
// integer form then applies.
inline int int_bias(const QuantWeights& q) {
  const float f = q.bias_factor;
  return q.biases == nullptr && f == std::rint(f) && std::abs(f) <= 256.0f ? int(f) : 0;
}

// y (M x N) for x in `qx`, x rows in the lanes, `tasks` runs of tiles on the pool; ib: the
// integer bias form (`int_bias`).
void qmm_int8_lanes(const QuantWeights& q, const QuantX8& qx, int64_t M, float* y, int tasks,
                    bool ib);

}  // namespace kvchat::tiled
