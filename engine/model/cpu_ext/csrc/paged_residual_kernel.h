// One decode call over a residual-format pool, as the kernel reads it
// (paged_residual_kernel.cpp; the op and its checks: paged_residual.cpp).
#pragma once

#include <cstdint>

#include "paged_decode_kernel.h"

namespace kvchat {

constexpr int kResidualMaxHeads = 8;  // query heads per task (a GQA group in chunks of this)
constexpr int kResidualHeadDims[] = {64, 128};  // the head dims the kernel is built for

struct ResidualProblem {
  const float* q;  // (B, Hq, D) scaled queries, for exact (residual) keys
  const float* qk;  // the same times R where the quantized keys are rotated
  const uint8_t* k_codes;  // (Hkv, num_blocks, D, k_width)
  const void* k_scales;  // (Hkv, num_blocks, D)
  const void* k_biases;
  Elem k_elem;
  int k_bits, k_width;  // k_width = BS * k_bits / 8
  Side v;  // per-token quantized value rows
  const void* res_k;  // (Hkv, nres, BS, D)
  const void* res_v;
  Elem res_elem;
  int nres;
  const int32_t* res_map;  // (num_blocks,)
  const int32_t* tables;
  int64_t table_width;
  const int32_t* lens;
  int B, Hq, Hkv, D, BS, num_blocks;
  int heads_per_task, head_chunks;
  int window;  // > 0: a row sees its last `window` positions only (sliding-window layers)
  const float* sinks;  // (Hq,) or null
  const float* signs;  // R's (D,) signs, or null
  bool rotate_v;
};

// out (B, Hq, D) float32.
void run_residual_decode(const ResidualProblem& pb, float* out);

}  // namespace kvchat
