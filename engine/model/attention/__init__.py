"""Attention over the block-paged KV pool: one home for every backend.

The contract (every path computes the same thing; `reference` is its definition):

    paged_attention(queries, k_pool, v_pool, block_tables, context_lens, spec,
                    *, block_run=None, use_kernels=True) -> (B, Hq, L, D)

- queries: (B, Hq, L, D), the L newest positions of each sequence. L == 1 is a decode
  step, B == 1 with L > 1 a prefill chunk, B > 1 with L > 1 a multi-token verify (a
  speculative draft checked in one forward);
- k_pool, v_pool: one layer's pool sides, (Hkv, num_blocks, block_size, D), Hq % Hkv == 0
  (GQA); head-major, so one sequence's blocks gather into the (Hkv, T, D) attention wants.
  Each is a float array or a `QuantizedBlocks` (a KV format: the reference dequantizes
  the blocks it reads, kernels in registers). A new format is a new pool type: the
  reference reads it through `gather` / `run`, and each kernel's `supports` declines it
  until the kernel learns it;
- block_tables: (B, max_blocks) int32 physical block ids; entries past a sequence's last
  block are padding (any valid id, never read unmasked);
- context_lens: B host ints, tokens of each sequence *including* the L new ones (already
  written to the pool); query i of sequence b sits at position context_lens[b] - L + i
  and sees keys 0..that position (causal);
- spec: the layer's `AttentionSpec` (softmax scale; ``window``: sees only the last W
  positions; ``sinks``: a learned per-head logit in every softmax), or a bare scale;
- block_run: B == 1 and the sequence's blocks are the contiguous run s, s+1, ... (read as
  a view of the pool instead of gathered);
- returns (B, Hq, L, D) in the queries' dtype.

Which path runs is `routes.ROUTES` (CPU extension, Metal/CUDA one- and two-pass kernels,
the reference), one table for every backend; each kernel variant's first launch is
checked against the reference and any failure turns kernels off for the process
(`guard`). Callers never choose a path: they describe the call.
"""

from engine.model.attention.dispatch import paged_attention, validated_kernel
from engine.model.attention.spec import AttentionSpec, PagedCall, contiguous_run

__all__ = ["AttentionSpec", "PagedCall", "contiguous_run", "paged_attention", "validated_kernel"]
