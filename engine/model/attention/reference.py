"""The pure-MLX reference: gather each sequence's blocks, then MLX's SDPA.

The test oracle of every kernel and the fallback of every backend. With one sequence
the gathered K/V are cut to its exact length, so the computation is the one a dense
cache does (token-exact with mlx-lm). It implements the whole contract, windows and
sinks included, so a kernel may decline anything it does not do.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from engine.model.attention.spec import AttentionSpec, Pool


def gather_blocks(pool: Pool, block_tables: mx.array) -> mx.array:
    """(H, num_blocks, bs, D) pool -> (B, H, max_blocks * bs, D) K or V.

    A quantized pool is dequantized after the gather: only the blocks read.
    """
    B, nb = block_tables.shape
    H, _, bs, D = pool.shape
    take = (lambda t: pool[:, t]) if isinstance(pool, mx.array) else pool.gather
    if B == 1:
        return take(block_tables[0]).reshape(1, H, nb * bs, D)
    return take(block_tables).reshape(H, B, nb * bs, D).transpose(1, 0, 2, 3)


def _run_rows(pool: Pool, start: int, stop: int) -> mx.array:
    """(1, H, stop - start, D): a contiguous run of token rows, a view when not quantized."""
    if not isinstance(pool, mx.array):  # a stored format (`spec.PoolFormat`)
        return pool.run(start, stop)[None]
    H, _, _, D = pool.shape
    return pool.reshape(H, -1, D)[None, :, start:stop]


def causal_mask(context_lens: Sequence[int], L: int, T: int, window: int | None = None,
                first_key: int = 0) -> mx.array:
    """(B, 1, L, T) boolean mask: query i of seq b sees keys <= its position, and with
    ``window`` only the last ``window`` of them. Key column j is position first_key + j."""
    lens = mx.array(list(context_lens), dtype=mx.int32)
    q_pos = (lens[:, None] - L + mx.arange(L, dtype=mx.int32)[None, :])[:, :, None]
    k_pos = (first_key + mx.arange(T, dtype=mx.int32))[None, None, :]
    visible = k_pos <= q_pos
    if window is not None:
        visible = visible & (k_pos > q_pos - window)
    return visible[:, None]


def length_groups(context_lens: Sequence[int], block_size: int) -> list[list[int]]:
    """Batch rows grouped by similar length (ascending), so padding stays under ~2x.

    A ragged decode batch padded to its longest sequence gathers and attends over
    B x longest tokens; one long chat among short ones would multiply the work.
    """
    lens = [int(n) for n in context_lens]
    order = sorted(range(len(lens)), key=lens.__getitem__)
    groups = [[order[0]]]
    for i in order[1:]:
        first = lens[groups[-1][0]]
        if lens[i] > 2 * first and lens[i] - first > 8 * block_size:
            groups.append([i])
        else:
            groups[-1].append(i)
    return groups


def _grouped_decode(queries, k_pool, v_pool, block_tables, context_lens, spec, groups):
    """Decode attention per length group, results put back in the batch's order."""
    bs = k_pool.shape[2]
    outs, order = [], []
    for g in groups:
        lens = [int(context_lens[i]) for i in g]
        idx = mx.array(g, dtype=mx.int32)
        tables = block_tables[idx][:, : -(-max(lens) // bs)]
        outs.append(paged_attention_ref(queries[idx], k_pool, v_pool, tables, lens, spec))
        order += g
    inverse = [0] * len(order)
    for pos, row in enumerate(order):
        inverse[row] = pos
    return mx.concatenate(outs, axis=0)[mx.array(inverse, dtype=mx.int32)]


def _one_sequence(queries, keys, values, n: int, first_key: int, spec: AttentionSpec):
    """SDPA of one sequence's L newest queries over its keys first_key .. n - 1."""
    L = queries.shape[2]
    window = spec.window
    if window is not None and L == 1:  # the query sees exactly the last `window` keys
        cut = max(0, n - window - first_key)
        keys, values, window = keys[:, :, cut:], values[:, :, cut:], None
    if window is not None:
        mask = causal_mask([n], L, keys.shape[2], window, first_key)
    else:
        mask = "causal" if L > 1 else None
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=spec.scale,
                                                mask=mask, sinks=spec.sinks)


def paged_attention_ref(
    queries: mx.array,
    k_pool: Pool,
    v_pool: Pool,
    block_tables: mx.array,
    context_lens: Sequence[int],
    scale: float | AttentionSpec,
    *,
    block_run: int | None = None,
) -> mx.array:
    """Attention over the pool by gathering; the contract of `engine.model.attention`."""
    spec = AttentionSpec.of(scale)
    B, _, L, _ = queries.shape
    if B > 1 and L == 1:
        groups = length_groups(context_lens, k_pool.shape[2])
        if len(groups) > 1:
            return _grouped_decode(queries, k_pool, v_pool, block_tables, context_lens, spec,
                                   groups)
    if B == 1:
        n = int(context_lens[0])
        # A window lets the run start late: the keys before it are never read.
        first = 0 if spec.window is None else max(0, n - L - spec.window + 1)
        if block_run is not None:
            start = block_run * k_pool.shape[2]
            keys = _run_rows(k_pool, start + first, start + n)
            values = _run_rows(v_pool, start + first, start + n)
        else:
            keys = gather_blocks(k_pool, block_tables)[:, :, first:n]
            values = gather_blocks(v_pool, block_tables)[:, :, first:n]
        return _one_sequence(queries, keys.astype(queries.dtype), values.astype(queries.dtype),
                             n, first, spec)
    keys = gather_blocks(k_pool, block_tables).astype(queries.dtype)
    values = gather_blocks(v_pool, block_tables).astype(queries.dtype)
    mask = causal_mask(context_lens, L, keys.shape[2], spec.window)
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=spec.scale,
                                                mask=mask, sinks=spec.sinks)
