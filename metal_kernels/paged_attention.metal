// Paged decode attention: one query token per sequence against its block table.
// Body for mx.fast.metal_kernel (the same text runs on CUDA via cuda_backend.h).
//   inputs:  queries (B, Hq, 1, D) T; k_pool, v_pool (Hkv, num_blocks, BS, W)
//            with W = D plain values or D * bits / 32 packed words per row
//            (head-major: one head's block is BS contiguous rows);
//            block_tables (B, max_blocks) int32; context_lens (B,) int32;
//            scale (1,) float32; k_scales, k_biases, v_scales, v_biases
//            (Hkv, num_blocks, BS, D / group) for a quantized side, else one
//            unused placeholder element; attn_window (1,) int32: the layer sees
//            its last attn_window positions (0: all); attn_sinks (Hq,) float32
//            learned logits joining each head's softmax without a value, or
//            one placeholder of -FLT_MAX (no sinks: it adds exp(-huge) = 0)
//   output:  out (B, Hq, 1, D) T
//   template: T (queries dtype), D (head dim, multiple of 32), BS (block
//             size), NSG (simdgroups per threadgroup), KB / VB (bits of the K /
//             V side: 0 = plain float rows of D values, 4 or 8 = mx.quantize
//             rows of D * bits / 32 uint32 words, dequantized in registers),
//             KG / VG (their group sizes)
//   grid (32 * NSG, Hq, B), threadgroup (32 * NSG, 1, 1): one threadgroup per
//   (query head, sequence); simdgroup g takes tokens g, g + NSG, ...; lane l
//   owns dims [l * EPL, (l + 1) * EPL).
// MLX adds shape parameters when it finds "<input>_shape" in this text, so
// comments must not spell out other such names.
  constexpr int EPL = D / PA_SIMD_WIDTH;
  TG_ARRAY(float, tg_max, NSG);
  TG_ARRAY(float, tg_sum, NSG);
  TG_ARRAY(float, tg_out, NSG * D);

  const int lane = int(thread_index_in_simdgroup);
  const int sg = int(simdgroup_index_in_threadgroup);
  const int head = int(threadgroup_position_in_grid.y);
  const int seq = int(threadgroup_position_in_grid.z);
  const int num_seqs = queries_shape[0];
  const int num_q_heads = queries_shape[1];
  const int num_kv_heads = k_pool_shape[0];
  const int num_blocks = k_pool_shape[1];
  const int max_blocks = block_tables_shape[1];
  // Uniform per threadgroup: CUDA rounds the grid up to whole blocks.
  if (head >= num_q_heads || seq >= num_seqs) {
    return;
  }
  const int kv_head = head / (num_q_heads / num_kv_heads);
  const int num_tokens = context_lens[seq];
  // A sliding window: the query (position num_tokens - 1) sees the last attn_window keys.
  const int win = attn_window[0];
  const int t_first = win > 0 && num_tokens > win ? num_tokens - win : 0;

  // This lane's slice of the query, pre-scaled, in fp32.
  const int64_t q_offset = (int64_t(seq) * num_q_heads + head) * D + lane * EPL;
  const float softmax_scale = scale[0];
  float q[EPL];
  float o[EPL];
  for (int i = 0; i < EPL; ++i) {
    q[i] = pa_to_float(queries[q_offset + i]) * softmax_scale;
    o[i] = 0.0f;
  }

  // Online softmax over this simdgroup's tokens. The loop bound depends on sg
  // only, so simd_sum runs in control flow uniform across the simdgroup.
  float m = PA_FINITE_MIN;
  float l = 0.0f;
  const int64_t head_row = int64_t(kv_head) * num_blocks * BS;
  for (int t = t_first + sg; t < num_tokens; t += NSG) {
    const int block = block_tables[seq * max_blocks + t / BS];
    const int64_t row = head_row + int64_t(block) * BS + t % BS;
    const PaLaneRow<EPL> k = PaRowReader<KB, KG, D>::read(k_pool, k_scales, k_biases, row, lane);
    float s = 0.0f;
    for (int i = 0; i < EPL; ++i) {
      s += q[i] * k.v[i];
    }
    s = simd_sum(s);
    const float m_new = pa_max(m, s);
    const float alpha = pa_exp(m - m_new);
    const float p = pa_exp(s - m_new);
    l = l * alpha + p;
    const PaLaneRow<EPL> v = PaRowReader<VB, VG, D>::read(v_pool, v_scales, v_biases, row, lane);
    for (int i = 0; i < EPL; ++i) {
      o[i] = o[i] * alpha + p * v.v[i];
    }
    m = m_new;
  }

  // Publish the per-simdgroup partials, then merge them in one pass.
  if (lane == 0) {
    tg_max[sg] = m;
    tg_sum[sg] = l;
  }
  for (int i = 0; i < EPL; ++i) {
    tg_out[sg * D + lane * EPL + i] = o[i];
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // The head's sink joins the softmax as one more logit, with no value.
  const float sink = attn_sinks[attn_sinks_shape[0] == 1 ? 0 : head];
  float g_max = sink;
  for (int g = 0; g < NSG; ++g) {
    g_max = pa_max(g_max, tg_max[g]);
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
    out[out_offset + d] = pa_from_float<T>(acc * inv_denom);
  }
