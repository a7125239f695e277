// Paged decode attention, pass 2 of 2: merges a sequence's partitions.
// Body for mx.fast.metal_kernel (the same text runs on CUDA via cuda_backend.h).
//   inputs:  part_out (NP, B, Hq, D), part_max, part_sum (NP, B, Hq) float32
//            from paged_decode_split.metal; context_lens (B,) int32;
//            attn_window (1,) int32 and attn_sinks (Hq or 1,) float32 as in pass 1
//   output:  out (B, Hq, 1, D) T
//   template: T (output dtype), D (head dim), PS (tokens per partition, as
//             in pass 1)
//   grid (D, Hq, B), threadgroup (D, 1, 1): one thread per output element;
//   no simdgroup functions and no threadgroup memory.
// Only the ceil(context / PS) partitions that hold tokens are read.
  const int d = int(thread_position_in_threadgroup.x);
  const int head = int(threadgroup_position_in_grid.y);
  const int seq = int(threadgroup_position_in_grid.z);
  const int num_seqs = part_max_shape[1];
  const int num_q_heads = part_max_shape[2];
  if (d >= D || head >= num_q_heads || seq >= num_seqs) {
    return;
  }
  const int num_tokens = context_lens[seq];
  const int used = (num_tokens + PS - 1) / PS;
  // partitions wholly before a sliding window hold nothing (pass 1 skipped them)
  const int win = attn_window[0];
  const int skip = win > 0 && num_tokens > win ? (num_tokens - win) / PS : 0;
  const int64_t stride = int64_t(num_seqs) * num_q_heads;  // between partitions
  const int64_t first = int64_t(seq) * num_q_heads + head;

  // The head's sink joins the softmax as one more logit, with no value.
  const float sink = attn_sinks[attn_sinks_shape[0] == 1 ? 0 : head];
  float g_max = sink;
  for (int p = skip; p < used; ++p) {
    g_max = pa_max(g_max, part_max[first + p * stride]);
  }
  float denom = pa_exp(sink - g_max);
  float acc = 0.0f;
  for (int p = skip; p < used; ++p) {
    const int64_t slot = first + p * stride;
    const float w = pa_exp(part_max[slot] - g_max);
    denom += part_sum[slot] * w;
    acc += part_out[slot * D + d] * w;
  }
  out[first * D + d] = pa_from_float<T>(denom > 0.0f ? acc / denom : 0.0f);
