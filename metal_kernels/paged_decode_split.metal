// Paged decode attention, pass 1 of 2 (split-K): partial softmax over one
// partition of PS tokens, for all QPG query heads that share one KV head.
// Body for mx.fast.metal_kernel (the same text runs on CUDA via cuda_backend.h).
//   inputs:  as paged_attention.metal: queries, k_pool, v_pool, block_tables,
//            context_lens, scale, and the K/V sides' scales and biases
//   outputs: part_out (NP, B, Hq, D) float32: sum of exp(s - part max) * v;
//            part_max, part_sum (NP, B, Hq) float32: that max and sum of exp
//   template: T, D, BS, NSG, KB, KG, VB, VG as in paged_attention.metal;
//             QPG (query heads per threadgroup, dividing the GQA ratio: each
//             K/V row is read once for all of them), PS (tokens per partition)
//   grid (32 * NSG * NP, Hq / QPG, B), threadgroup (32 * NSG, 1, 1): one
//   threadgroup per (partition, head group, sequence); simdgroup g takes the
//   partition's tokens g, g + NSG, ...; lane l owns dims [l * EPL, (l + 1) * EPL).
// Partitions past a sequence's end write nothing: pass 2 reads only the
// ceil(context / PS) partitions of each sequence.
// MLX adds shape parameters when it finds "<input>_shape" in this text, so
// comments must not spell out other such names.
  constexpr int EPL = D / PA_SIMD_WIDTH;
  TG_ARRAY(float, tg_max, NSG);
  TG_ARRAY(float, tg_sum, NSG);
  TG_ARRAY(float, tg_out, NSG * D);

  const int lane = int(thread_index_in_simdgroup);
  const int sg = int(simdgroup_index_in_threadgroup);
  const int part = int(threadgroup_position_in_grid.x);
  const int head_group = int(threadgroup_position_in_grid.y);
  const int seq = int(threadgroup_position_in_grid.z);
  const int num_seqs = queries_shape[0];
  const int num_q_heads = queries_shape[1];
  const int num_kv_heads = k_pool_shape[0];
  const int num_blocks = k_pool_shape[1];
  const int max_blocks = block_tables_shape[1];
  const int first_head = head_group * QPG;
  const int num_tokens = context_lens[seq];
  // A sliding window: the query sees the last attn_window keys; partitions wholly
  // before them are skipped here and in pass 2.
  const int win = attn_window[0];
  const int t_first = win > 0 && num_tokens > win ? num_tokens - win : 0;
  const int begin = part * PS > t_first ? part * PS : t_first;
  // Uniform per threadgroup: CUDA rounds the grid up to whole blocks, and a
  // short sequence has fewer partitions than the longest.
  if (first_head >= num_q_heads || seq >= num_seqs || begin >= num_tokens ||
      (part + 1) * PS <= t_first) {
    return;
  }
  const int end = (part + 1) * PS < num_tokens ? (part + 1) * PS : num_tokens;
  const int kv_head = first_head / (num_q_heads / num_kv_heads);

  // This lane's slice of each query, pre-scaled, in fp32.
  const float softmax_scale = scale[0];
  float q[QPG][EPL];
  float o[QPG][EPL];
  float m[QPG];
  float l[QPG];
  for (int h = 0; h < QPG; ++h) {
    const int64_t q_offset = (int64_t(seq) * num_q_heads + first_head + h) * D + lane * EPL;
    for (int i = 0; i < EPL; ++i) {
      q[h][i] = pa_to_float(queries[q_offset + i]) * softmax_scale;
      o[h][i] = 0.0f;
    }
    m[h] = PA_FINITE_MIN;
    l[h] = 0.0f;
  }

  // Online softmax over this simdgroup's tokens of the partition: each K and
  // V row is read once and used by all QPG heads. Bounds depend on the
  // threadgroup and sg only, so simd_sum runs in uniform control flow.
  const int64_t head_row = int64_t(kv_head) * num_blocks * BS;
  for (int t = begin + sg; t < end; t += NSG) {
    const int block = block_tables[int64_t(seq) * max_blocks + t / BS];
    const int64_t row = head_row + int64_t(block) * BS + t % BS;
    const PaLaneRow<EPL> k = PaRowReader<KB, KG, D>::read(k_pool, k_scales, k_biases, row, lane);
    const PaLaneRow<EPL> v = PaRowReader<VB, VG, D>::read(v_pool, v_scales, v_biases, row, lane);
    for (int h = 0; h < QPG; ++h) {
      float s = 0.0f;
      for (int i = 0; i < EPL; ++i) {
        s += q[h][i] * k.v[i];
      }
      s = simd_sum(s);
      const float m_new = pa_max(m[h], s);
      const float alpha = pa_exp(m[h] - m_new);
      const float p = pa_exp(s - m_new);
      l[h] = l[h] * alpha + p;
      for (int i = 0; i < EPL; ++i) {
        o[h][i] = o[h][i] * alpha + p * v.v[i];
      }
      m[h] = m_new;
    }
  }

  // Merge the simdgroups' partials head by head through one set of
  // threadgroup arrays (QPG sets would not fit 32 KiB at D = 256).
  for (int h = 0; h < QPG; ++h) {
    if (lane == 0) {
      tg_max[sg] = m[h];
      tg_sum[sg] = l[h];
    }
    for (int i = 0; i < EPL; ++i) {
      tg_out[sg * D + lane * EPL + i] = o[h][i];
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    float g_max = PA_FINITE_MIN;
    for (int g = 0; g < NSG; ++g) {
      g_max = pa_max(g_max, tg_max[g]);
    }
    float weight[NSG];
    float denom = 0.0f;
    for (int g = 0; g < NSG; ++g) {
      weight[g] = pa_exp(tg_max[g] - g_max);
      denom += tg_sum[g] * weight[g];
    }
    const int64_t slot = (int64_t(part) * num_seqs + seq) * num_q_heads + first_head + h;
    for (int d = sg * PA_SIMD_WIDTH + lane; d < D; d += NSG * PA_SIMD_WIDTH) {
      float acc = 0.0f;
      for (int g = 0; g < NSG; ++g) {
        acc += tg_out[g * D + d] * weight[g];
      }
      part_out[slot * D + d] = acc;
    }
    if (sg == 0 && lane == 0) {
      part_max[slot] = g_max;
      part_sum[slot] = denom;
    }
    // The next head overwrites the arrays everyone just read.
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
