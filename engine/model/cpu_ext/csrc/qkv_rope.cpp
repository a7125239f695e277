// From a layer's fused q/k/v projection to attention's inputs (`layer_head`'s last
// step): the split, the head layouts, and RoPE of q and k with `rope`'s numerics
// exactly (float32 math rounded once to the projection's dtype). K and V come out in
// the layout `kv_write` takes.
#include <cstring>
#include <stdexcept>

#include "kernels.h"
#include "tensor.h"

namespace kvchat {

void qkv_rope_into(const mx::array& qkv, const mx::array& offsets, std::vector<mx::array>& out,
                   int heads, int kv_heads, const RopeParams& p, const float* freqs) {
  const Heads n{qkv.shape(0), qkv.shape(1), heads, kv_heads, out[0].shape(3)};
  std::vector<char> x_buf, o_buf;
  const char* xs = static_cast<const char*>(row_major(qkv, x_buf));
  const int32_t* offs = static_cast<const int32_t*>(row_major(offsets, o_buf));
  const Elem e = elem_of(qkv.dtype());
  const size_t item = qkv.itemsize();
  const int64_t width = (n.Hq + 2 * n.Hkv) * n.D, tokens = n.B * n.L;
  char* q = out[0].data<char>();
  char* k = out[1].data<char>();
  char* v = out[2].data<char>();
  const std::vector<float> inv_freq = rope_inv_freq(p, freqs);
  std::vector<float> row(n.D), cs(inv_freq.size() * 2);
  for (int64_t b = 0; b < n.B; ++b) {
    const int32_t off = offsets.size() == 1 ? offs[0] : offs[b];
    for (int64_t l = 0; l < n.L; ++l) {
      rope_angles(p, inv_freq, float(l) + float(off), cs.data());
      const int64_t t = b * n.L + l;  // the token's row in the K/V layout
      const int64_t at = t * width;
      for (int64_t h = 0; h < n.Hq + n.Hkv; ++h) {  // q heads, then k heads: rotated
        for (int64_t d = 0; d < n.D; ++d) row[d] = scalar_any(xs, e, at + h * n.D + d);
        rope_rotate(p, cs.data(), row.data());
        char* dst = h < n.Hq ? q + ((b * n.Hq + h) * n.L + l) * n.D * item
                             : k + ((h - n.Hq) * tokens + t) * n.D * item;
        store_any(dst, e, row.data(), n.D);
      }
      for (int64_t h = 0; h < n.Hkv; ++h)  // v heads as they are
        std::memcpy(v + (h * tokens + t) * n.D * item,
                    xs + (at + (n.Hq + n.Hkv + h) * n.D) * item, n.D * item);
    }
  }
}

}  // namespace kvchat
