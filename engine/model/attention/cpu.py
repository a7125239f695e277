"""Paged attention on kvchat's C++ CPU extension (csrc/paged_attention.cpp): typed
entry points and what they take. Sliding windows and sinks are the extension's too.

One op reads K/V through the block table (no gather copy, no cast of a float16 pool,
no padding of ragged batches), decode and prefill alike; prefill tiles flash-style and
never holds an L x T array. The extension builds on first use (`cpu_ext.build`).
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from engine.kvcache import rotation
from engine.kvcache.quantized_blocks import QuantizedBlocks
from engine.model.attention.spec import AttentionSpec, PagedCall, Pool
from engine.model.cpu_ext import build

QUANT_BITS = (4, 8)
FLOAT_DTYPES = (mx.float32, mx.float16, mx.bfloat16)


def available() -> bool:
    """Whether the extension is built and loaded here (builds it on the first call)."""
    return build.load() is not None


def _side(pool: Pool) -> dict:
    if isinstance(pool, QuantizedBlocks):
        q = pool.quant
        return dict(rows=pool.data, scales=pool.scales, biases=pool.biases, bits=q.bits,
                    group=q.group_size)
    return dict(rows=pool, scales=None, biases=None, bits=0, group=0)


def lens_array(context_lens: Sequence[int] | mx.array) -> mx.array:
    """Context lengths as the int32 array the extension's ops take."""
    if not isinstance(context_lens, mx.array):
        return mx.array([int(n) for n in context_lens], dtype=mx.int32)
    return context_lens.astype(mx.int32)


def _paged(queries, k_pool, v_pool, block_tables, context_lens, scale,
           rotated: tuple[bool, bool] = (False, False)) -> mx.array:
    spec = AttentionSpec.of(scale)
    k, v = _side(k_pool), _side(v_pool)
    signs = rotation.signs(queries.shape[-1]) if any(rotated) else None
    return build.require().paged_attention(
        queries, k["rows"], v["rows"], block_tables.astype(mx.int32),
        lens_array(context_lens), scale=float(spec.scale), window=spec.window or 0,
        sinks=spec.sinks,
        k_scales=k["scales"], k_biases=k["biases"], k_bits=k["bits"], k_group=k["group"],
        v_scales=v["scales"], v_biases=v["biases"], v_bits=v["bits"], v_group=v["group"],
        rotation=signs, rotate_queries=rotated[0], unrotate_out=rotated[1])


def paged_decode(queries: mx.array, k_pool: Pool, v_pool: Pool, block_tables: mx.array,
                 context_lens: Sequence[int] | mx.array,
                 scale: float | AttentionSpec, *,
                 rotated: tuple[bool, bool] = (False, False)) -> mx.array:
    """Decode attention read through the block table (plain layers).

    Args:
        queries: (B, Hq, 1, D), D a multiple of 16.
        k_pool, v_pool: (Hkv, num_blocks, block_size, D) float pools, or `QuantizedBlocks`
            (4/8-bit rows, group dividing D).
        block_tables: (B, max_blocks) int32 physical block ids.
        context_lens: B ints, tokens per sequence including the new one.
        scale: softmax scale, or the layer's `AttentionSpec` (its window and sinks).
        rotated: (K, V) stored rotated (`kvcache.rotation`): the op rotates the queries
            first (K) and the outputs back (V), as `rotation.rotate` / `unrotate` would
            around it, bit for bit, without their two graph nodes.

    Returns:
        (B, Hq, 1, D) in the queries' dtype.
    """
    if queries.ndim != 4 or queries.shape[2] != 1:
        raise ValueError(f"paged_decode: queries must be (B, Hq, 1, D), not {queries.shape}")
    return _paged(queries, k_pool, v_pool, block_tables, context_lens, scale, rotated)


def paged_prefill(queries: mx.array, k_pool: Pool, v_pool: Pool, block_tables: mx.array,
                  context_lens: Sequence[int] | mx.array,
                  scale: float | AttentionSpec, *,
                  rotated: tuple[bool, bool] = (False, False)) -> mx.array:
    """Causal attention of each sequence's L newest positions (already written to the
    pool) over its blocks: `paged_decode`'s arguments with queries (B, Hq, L, D); query i
    of sequence b sits at position ``context_lens[b] - L + i``.

    Returns:
        (B, Hq, L, D) in the queries' dtype.
    """
    return _paged(queries, k_pool, v_pool, block_tables, context_lens, scale, rotated)


def supports(queries: mx.array, k_pool: Pool, v_pool: Pool) -> bool:
    """Whether `paged_decode` / `paged_prefill` take these shapes and dtypes."""
    B, Hq, L, D = queries.shape
    Hkv = k_pool.shape[0]

    def side_ok(pool) -> bool:
        if isinstance(pool, QuantizedBlocks):
            q = pool.quant
            return (q.bits in QUANT_BITS and q.group_size % 32 == 0 and D % q.group_size == 0
                    and pool.scales.dtype in FLOAT_DTYPES and pool.head_dim == D)
        # float rows; any other stored format is not the extension's
        return isinstance(pool, mx.array) and pool.dtype in FLOAT_DTYPES and pool.shape[3] == D

    return (D % 16 == 0 and Hq % Hkv == 0 and queries.dtype in FLOAT_DTYPES
            and side_ok(k_pool) and side_ok(v_pool) and k_pool.shape[:3] == v_pool.shape[:3])


def _variant(pool: Pool) -> tuple:
    if isinstance(pool, QuantizedBlocks):
        return ("q", pool.quant.bits, pool.quant.group_size, pool.scales.dtype)
    return ("f", pool.dtype)


def variant_key(call: PagedCall) -> tuple:
    """What the first-launch check tells apart: the kind, dtypes, GQA, dims, pool formats."""
    q = call.queries
    return (call.kind != "decode", q.dtype, call.gqa_ratio, q.shape[3],
            call.k_pool.shape[2], _variant(call.k_pool), _variant(call.v_pool))
