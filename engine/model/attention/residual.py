"""Attention over a residual-format pool (`ResidualBlocks`): the reference for that format.

The rule: a query at position p reads the blocks before its own block quantized and its
own block exact (the residual rows, still held in the step the block fills). A decode query
reads `ResidualBlocks.gather` (exact where residual) with only its own block mapped: the
rows of a verify step are one sequence's decode rows, and a later one must read quantized
the block an earlier one filled. A chunk of several queries
spans blocks, so each query sees a block exact or quantized by where it sits: the keys are
the quantized rows before the last query's block and the exact rows of the chunk's blocks,
and the mask picks per query. No chunking or batching changes what a query reads.
"""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx

from engine.model.attention import reference
from engine.model.attention.spec import AttentionSpec, PagedCall


def _chunk(queries: mx.array, k_pool, v_pool, table: mx.array, n: int,
           spec: AttentionSpec) -> mx.array:
    """One sequence's L newest queries (positions n - L .. n - 1) over its n keys."""
    L = queries.shape[2]
    H, _, bs, D = k_pool.shape
    first, last = (n - L) // bs, (n - 1) // bs  # blocks of the first and the last query
    start = first * bs

    def keys_of(pool) -> mx.array:
        exact = pool.exact_rows(table[first:last + 1]).reshape(H, -1, D)[:, :n - start]
        if last == 0:
            return exact[None]
        quant = pool.quantized_rows(table[:last]).reshape(H, -1, D).astype(exact.dtype)
        return mx.concatenate([quant, exact], axis=1)[None]

    pos = mx.arange(n - L, n, dtype=mx.int32)[:, None]  # (L, 1) query positions
    own = (pos // bs) * bs  # first position of each query's block
    q_keys = mx.arange(last * bs, dtype=mx.int32)[None, :]
    e_keys = mx.arange(start, n, dtype=mx.int32)[None, :]
    visible = mx.concatenate([q_keys < own, (e_keys >= own) & (e_keys <= pos)], axis=1)
    if spec.window is not None:
        key_pos = mx.concatenate([q_keys, e_keys], axis=1)
        visible = visible & (key_pos > pos - spec.window)
    keys, values = keys_of(k_pool), keys_of(v_pool)
    return mx.fast.scaled_dot_product_attention(
        queries, keys.astype(queries.dtype), values.astype(queries.dtype), scale=spec.scale,
        mask=visible[None, None], sinks=spec.sinks)


def _own_block_exact(pool, own: mx.array):
    """``pool`` with only block ``own`` exact: a decode row's earlier block may still be
    mapped when this step filled it (a verify step's drafts); the rule reads it quantized."""
    ids = mx.arange(pool.res_map.shape[0], dtype=mx.int32)
    return replace(pool, res_map=mx.where(ids == own, pool.res_map, -1))


def residual_attention(call: PagedCall) -> mx.array:
    """Attention of ``call`` (its pools `ResidualBlocks`) by the rule above; (B, Hq, L, D).

    One sequence at a time, each over exactly its own blocks: a row computes alike alone
    and in any batch (no padding, no mask of other lengths), so batching changes no token.
    """
    bs = call.k_pool.shape[2]
    outs = []
    for b, n in enumerate(call.context_lens):
        q, table = call.queries[b:b + 1], call.block_tables[b, :-(-n // bs)]
        if call.kind == "decode":  # gather is the rule once only its own block is exact
            k, v = (_own_block_exact(p, table[-1]) for p in (call.k_pool, call.v_pool))
            outs.append(reference.paged_attention_ref(q, k, v, table[None], [n], call.spec))
        else:
            outs.append(_chunk(q, call.k_pool, call.v_pool, table, n, call.spec))
    return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)
