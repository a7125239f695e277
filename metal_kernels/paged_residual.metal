// Paged decode attention over a residual-format pool (engine/kvcache/residual.py): a
// query reads the blocks before its own quantized (keys per channel within the block,
// values per token) and its own block exact from the residual rows, when the residual map
// holds it. Body for mx.fast.metal_kernel (the same text runs on CUDA via cuda_backend.h).
//   inputs:  queries (B, Hq, 1, D) T, in the quantized keys' space (the caller rotates
//            them where the pool is rotated); k_codes (Hkv, num_blocks, D, BS * KB / 8)
//            uint8, one channel's BS codes together (4-bit: token 2i in byte i's low
//            nibble, 2i + 1 in its high one); k_scales, k_biases (Hkv, num_blocks, D):
//            key = code * scale + bias; v_pool (Hkv, num_blocks, BS, D * VB / 32) uint32
//            mx.quantize rows with v_scales, v_biases (Hkv, num_blocks, BS, D / VG);
//            res_k, res_v (Hkv, num_residual * BS, D) float rows in the quantized sides'
//            spaces; res_map (num_blocks,) int32: a block's residual row or -1;
//            block_tables, context_lens, scale, attn_window, attn_sinks as in
//            paged_attention.metal
//   output:  out (B, Hq, 1, D) T, in the quantized values' space; NaN for a sequence
//            whose table names a block outside the pool or the residual rows
//   template: T, D (multiple of 32), BS (block size, even), NSG (simdgroups per
//             threadgroup), KB / VB (4 or 8 bits of K / V), VG (V's group size)
//   grid (32 * NSG, Hq, B), threadgroup (32 * NSG, 1, 1): one threadgroup per (query
//   head, sequence); simdgroup g takes tokens g, g + NSG, ...; lane l owns dims
//   [l * EPL, (l + 1) * EPL).
// MLX adds shape parameters when it finds "<input>_shape" in this text, so comments must
// not spell out other such names.
  constexpr int EPL = D / PA_SIMD_WIDTH;
  constexpr int KW = BS * KB / 8;  // bytes of one channel's codes in a block
  TG_ARRAY(float, tg_max, NSG);
  TG_ARRAY(float, tg_sum, NSG);
  TG_ARRAY(int, tg_bad, NSG);
  TG_ARRAY(float, tg_out, NSG * D);

  const int lane = int(thread_index_in_simdgroup);
  const int sg = int(simdgroup_index_in_threadgroup);
  const int head = int(threadgroup_position_in_grid.y);
  const int seq = int(threadgroup_position_in_grid.z);
  const int num_seqs = queries_shape[0];
  const int num_q_heads = queries_shape[1];
  const int num_kv_heads = k_codes_shape[0];
  const int num_blocks = k_codes_shape[1];
  const int res_rows = res_k_shape[1];
  const int max_blocks = block_tables_shape[1];
  // Uniform per threadgroup: CUDA rounds the grid up to whole blocks.
  if (head >= num_q_heads || seq >= num_seqs) {
    return;
  }
  const int kv_head = head / (num_q_heads / num_kv_heads);
  const int num_tokens = context_lens[seq];
  const int win = attn_window[0];
  const int t_first = win > 0 && num_tokens > win ? num_tokens - win : 0;
  // The rule is by position: only the row's own block is read exact, where mapped.
  const int own = (num_tokens - 1) / BS;
  const int own_block = block_tables[seq * max_blocks + own];
  const bool own_ok = own_block >= 0 && own_block < num_blocks;
  const int own_res = own_ok ? res_map[own_block] : -1;
  int bad = !own_ok || (own_res >= 0 && (own_res + 1) * BS > res_rows) ? 1 : 0;

  const int64_t q_offset = (int64_t(seq) * num_q_heads + head) * D + lane * EPL;
  const float softmax_scale = scale[0];
  float q[EPL];
  float o[EPL];
  for (int i = 0; i < EPL; ++i) {
    q[i] = pa_to_float(queries[q_offset + i]) * softmax_scale;
    o[i] = 0.0f;
  }

  // Online softmax over this simdgroup's tokens; every branch below depends on the token
  // only, so simd_sum runs in control flow uniform across the simdgroup.
  float m = PA_FINITE_MIN;
  float l = 0.0f;
  const int64_t kv_blocks = int64_t(kv_head) * num_blocks;
  const int64_t res_row0 = int64_t(kv_head) * res_rows + int64_t(own_res) * BS;
  for (int t = t_first + sg; t < num_tokens && bad == 0; t += NSG) {
    const int j = t / BS;
    const int r = t % BS;
    const int block = block_tables[seq * max_blocks + j];
    if (block < 0 || block >= num_blocks) {
      bad = 1;
      break;
    }
    const bool exact = j == own && own_res >= 0;
    float k[EPL];
    if (exact) {
      const int64_t row = (res_row0 + r) * D + lane * EPL;
      for (int i = 0; i < EPL; ++i) {
        k[i] = pa_to_float(res_k[row + i]);
      }
    } else {
      const int64_t chan0 = (kv_blocks + block) * D + lane * EPL;
      for (int i = 0; i < EPL; ++i) {
        const uint32_t byte = uint32_t(k_codes[(chan0 + i) * KW + r * KB / 8]);
        const uint32_t code = KB == 8 ? byte : (byte >> ((r & 1) * 4)) & 15u;
        k[i] = float(code) * pa_to_float(k_scales[chan0 + i]) + pa_to_float(k_biases[chan0 + i]);
      }
    }
    float s = 0.0f;
    for (int i = 0; i < EPL; ++i) {
      s += q[i] * k[i];
    }
    s = simd_sum(s);
    const float m_new = pa_max(m, s);
    const float alpha = pa_exp(m - m_new);
    const float p = pa_exp(s - m_new);
    l = l * alpha + p;
    if (exact) {
      const int64_t row = (res_row0 + r) * D + lane * EPL;
      for (int i = 0; i < EPL; ++i) {
        o[i] = o[i] * alpha + p * pa_to_float(res_v[row + i]);
      }
    } else {
      // value = code * scale + bias in float32, as the CPU kernel reads it (not rounded
      // to the scales' type as mx.dequantize is: common.h's PaRowReader)
      const int64_t row = (kv_blocks + block) * BS + r;
      for (int i = 0; i < EPL; ++i) {
        const int dim = lane * EPL + i;
        const uint32_t word = v_pool[row * (D * VB / 32) + dim / (32 / VB)];
        const uint32_t code = (word >> ((dim % (32 / VB)) * VB)) & ((1u << VB) - 1u);
        const int64_t group = row * (D / VG) + dim / VG;
        const float v = float(code) * pa_to_float(v_scales[group]) + pa_to_float(v_biases[group]);
        o[i] = o[i] * alpha + p * v;
      }
    }
    m = m_new;
  }

  if (lane == 0) {
    tg_max[sg] = m;
    tg_sum[sg] = l;
    tg_bad[sg] = bad;
  }
  for (int i = 0; i < EPL; ++i) {
    tg_out[sg * D + lane * EPL + i] = o[i];
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  const float sink = attn_sinks[attn_sinks_shape[0] == 1 ? 0 : head];
  float g_max = sink;
  int any_bad = 0;
  for (int g = 0; g < NSG; ++g) {
    g_max = pa_max(g_max, tg_max[g]);
    any_bad |= tg_bad[g];
  }
  float weight[NSG];
  float denom = pa_exp(sink - g_max);
  for (int g = 0; g < NSG; ++g) {
    weight[g] = pa_exp(tg_max[g] - g_max);
    denom += tg_sum[g] * weight[g];
  }
  const float inv_denom = denom > 0.0f ? 1.0f / denom : 0.0f;
  const int64_t out_offset = (int64_t(seq) * num_q_heads + head) * D;
  for (int d = sg * PA_SIMD_WIDTH + lane; d < D; d += NSG * PA_SIMD_WIDTH) {
    float acc = 0.0f;
    for (int g = 0; g < NSG; ++g) {
      acc += tg_out[g * D + d] * weight[g];
    }
    out[out_offset + d] = pa_from_float<T>(any_bad != 0 ? pa_nan() : acc * inv_denom);
  }
