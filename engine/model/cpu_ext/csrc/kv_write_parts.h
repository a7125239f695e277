// Writing one step's K and V rows into a layer's stores: the routines the one-part writes
// (kv_write.cpp, kv_write_quant.cpp) run, and `kv_write_sides`, which runs them for every
// part of both sides in one node (kv_write_sides.cpp).
#pragma once

#include <optional>
#include <vector>

#include "kv_write_quant.h"

namespace kvchat {

// The rows (cast to the pool's dtype) written at `slots` into `out`, a copy of `pool` unless
// donated (its buffer already). Checks: pool (H, S, ...), rows (H, N, ...), slots (N,) int32.
void check_float_write(const mx::array& pool, const mx::array& slots, const mx::array& rows);
void write_float_rows(const mx::array& pool, const mx::array& slots, const mx::array& rows,
                      mx::array& out, bool donated);

// The rows quantized (rotated first by `rotation`'s signs) into the parts of `outs` (null: a
// part not written): outs[0] packed rows, outs[1] scales, outs[2] biases; each part's old
// contents (pools[i]) copied first unless donated.
void check_quant_part(const mx::array& pool, const mx::array& slots, const mx::array& rows,
                      const std::optional<mx::array>& rotation, int part, int bits, int group);
void write_quant_parts(const mx::array* pools, const mx::array& slots, const mx::array& rows,
                       const mx::array* rotation, mx::array* const* outs, const bool* donated,
                       const QuantWrite& q);

// How one side is stored: bits 0 a float pool (one array), else 4 or 8-bit rows quantized per
// token in groups of `group` (three arrays: packed rows, scales, biases), rotated or not.
struct SideFormat {
  int bits = 0, group = 0;
  bool rotate = false;
};

class KvWriteSides : public mx::Primitive {
 public:
  KvWriteSides(mx::Stream stream, SideFormat k, SideFormat v)
      : mx::Primitive(stream), k_(k), v_(v) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override {
    return "KvchatKvWriteSides";
  }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  SideFormat k_, v_;
};

// Every array of a layer's K store (`keys`) and V store (`values`), as `k` and `v` say they
// are stored, with this step's rows (H, N, D) written at slots (N,): one node for both sides,
// each array updated in place when nothing else holds it (the same bytes as `kv_write` /
// `kv_write_quant` part by part). `rotation`: R's (D,) signs, needed when a side rotates.
std::vector<mx::array> kv_write_sides(const std::vector<mx::array>& keys,
                                      const std::vector<mx::array>& values,
                                      const mx::array& slots, const mx::array& k_rows,
                                      const mx::array& v_rows,
                                      const std::optional<mx::array>& rotation, SideFormat k,
                                      SideFormat v, mx::StreamOrDevice s = {});

}  // namespace kvchat
