"""Typed wrappers of the extension's primitives (build it first: `build.available()`)."""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from engine.kvcache.kv_cache import QuantizedBlocks
from engine.model.cpu_ext import build

QMM_BITS = (4, 8)
QMM_GROUP_SIZES = (32, 64, 128)
FLOAT_DTYPES = (mx.float32, mx.float16, mx.bfloat16)


def _ext():
    module = build.load()
    if module is None:
        raise RuntimeError(f"the CPU extension is unavailable: {build.unavailable_reason()}")
    return module


def qmm(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, *, group_size: int,
        bits: int, tiled: bool = False) -> mx.array:
    """``x @ dequantize(w, scales, biases).T``: `mx.quantized_matmul` with ``transpose=True``.

    Args:
        x: (..., K) float32, float16 or bfloat16.
        w: (N, K * bits / 32) uint32, packed by `mx.quantize` (affine mode).
        scales, biases: (N, K / group_size), one float dtype.
        group_size: 32, 64 or 128.
        bits: 4 or 8.
        tiled: w, scales and biases are in the tiled layout (`tile`), and
            x is multiplied as int16 per group (AVX-512 VNNI; `tiled_supported`).

    Returns:
        (..., N) in the promoted dtype of x and scales; accumulated in float32.
    """
    return _ext().qmm(x, w, scales, biases, group_size=group_size, bits=bits, tiled=tiled)


def kv_write(pool: mx.array, slots: mx.array, rows: mx.array) -> mx.array:
    """``pool`` (H, S, D) with ``rows`` (H, N, D) written at ``slots`` (N,) as one op: what
    ``pool[:, slots] = rows`` computes (rows cast to the pool's dtype), in place when the
    pool is donated. Slots outside the pool are skipped."""
    return _ext().kv_write(pool, slots.astype(mx.int32) if slots.dtype != mx.int32 else slots,
                           rows)


def greedy_pick(logits: mx.array) -> mx.array:
    """(rows, vocab) float logits -> (rows,) int32: each row's greedy token where it provably
    equals mlx-lm's ``argmax(logits - logsumexp(logits))`` (see csrc/greedy.cpp), else -1."""
    return _ext().greedy_pick(logits)


def tiled_supported() -> bool:
    """Whether the extension has the tiled matmul (built with AVX-512 VNNI)."""
    return bool(_ext().tiled_supported())


TILE_ROWS = 16


def tile(w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int,
         ) -> tuple[mx.array, mx.array, mx.array]:
    """MLX 4/8-bit affine weights (N, K * bits / 32) rearranged into the tiled layout `qmm`
    reads with ``tiled=True``; same shapes, dtypes and bytes, another order.

    Rows go in tiles of 16. For tile t, group g and quad j (4 weights) of the group,
    16 rows x 4 bytes: byte 4i + b is weight ``g * group + 4j + b`` of row ``16t + i``
    (one int32 lane per row). 4 bits: quads 2p and 2p + 1 share 64 bytes, 2p in the low
    nibbles. Scales and biases go (t, g, i). Row slices at multiples of 16 stay valid tiles.
    """
    N, packed = w.shape
    K = packed * 32 // bits
    G = K // group_size
    if (N % TILE_ROWS or group_size % 32 or w.dtype != mx.uint32 or bits not in (4, 8)
            or scales.shape != (N, G)):
        raise ValueError(f"tile: needs rows in 16s, groups of 32s and 4/8-bit uint32 w, "
                         f"not {w.shape}")
    T = N // TILE_ROWS
    if bits == 8:
        q = w.view(mx.uint8).reshape(T, TILE_ROWS, G, group_size // 4, 4)  # (t, i, g, j, b)
        tiled = q.transpose(0, 2, 3, 1, 4).reshape(N, K).view(mx.uint32)
    else:
        shifts = mx.arange(0, 32, 4, dtype=mx.uint32)
        q = ((w[:, :, None] >> shifts) & 0xF).astype(mx.uint8)  # (N, K / 8, 8): natural order
        q = q.reshape(T, TILE_ROWS, G, group_size // 8, 2, 4)  # (t, i, g, p, half, b)
        q = q.transpose(0, 2, 3, 4, 1, 5)  # (t, g, p, half, i, b)
        tiled = (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).reshape(N, K // 2).view(mx.uint32)

    def params(a: mx.array) -> mx.array:
        return a.reshape(T, TILE_ROWS, G).transpose(0, 2, 1).reshape(N, G)

    return tiled.reshape(N, packed), params(scales), params(biases)


def untile8_rows(w: mx.array, scales: mx.array, biases: mx.array, rows: mx.array,
                 group_size: int) -> tuple[mx.array, mx.array, mx.array]:
    """Rows ``rows`` (any int shape) of `tile`d 8-bit weights back in MLX's layout: what
    ``w[rows], scales[rows], biases[rows]`` gave before tiling (an embedding lookup)."""
    N, packed = w.shape
    K, G = packed * 4, scales.shape[1]
    T = N // TILE_ROWS
    t, i = rows // TILE_ROWS, rows % TILE_ROWS
    q = w.view(mx.uint8).reshape(T, G, group_size // 4, TILE_ROWS, 4).transpose(0, 3, 1, 2, 4)
    data = q[t, i].reshape(*rows.shape, K).view(mx.uint32)

    def params(a: mx.array) -> mx.array:
        return a.reshape(T, G, TILE_ROWS).transpose(0, 2, 1)[t, i]

    return data, params(scales), params(biases)


def _side(pool: mx.array | QuantizedBlocks) -> dict:
    if isinstance(pool, QuantizedBlocks):
        q = pool.quant
        return dict(rows=pool.data, scales=pool.scales, biases=pool.biases, bits=q.bits,
                    group=q.group_size)
    return dict(rows=pool, scales=None, biases=None, bits=0, group=0)


def _paged(queries, k_pool, v_pool, block_tables, context_lens, scale) -> mx.array:
    if not isinstance(context_lens, mx.array):
        context_lens = mx.array([int(n) for n in context_lens], dtype=mx.int32)
    k, v = _side(k_pool), _side(v_pool)
    return _ext().paged_attention(
        queries, k["rows"], v["rows"], block_tables.astype(mx.int32),
        context_lens.astype(mx.int32), scale=float(scale),
        k_scales=k["scales"], k_biases=k["biases"], k_bits=k["bits"], k_group=k["group"],
        v_scales=v["scales"], v_biases=v["biases"], v_bits=v["bits"], v_group=v["group"])


def paged_decode(queries: mx.array, k_pool: mx.array | QuantizedBlocks,
                 v_pool: mx.array | QuantizedBlocks, block_tables: mx.array,
                 context_lens: Sequence[int] | mx.array, scale: float) -> mx.array:
    """Decode attention read through the block table; the contract of `paged_attention`.

    Args:
        queries: (B, Hq, 1, D), D a multiple of 16.
        k_pool, v_pool: (Hkv, num_blocks, block_size, D) float pools, or `QuantizedBlocks`
            (4/8-bit rows, group dividing D).
        block_tables: (B, max_blocks) int32 physical block ids.
        context_lens: B ints, tokens per sequence including the new one.
        scale: softmax scale.

    Returns:
        (B, Hq, 1, D) in the queries' dtype.
    """
    if queries.ndim != 4 or queries.shape[2] != 1:
        raise ValueError(f"paged_decode: queries must be (B, Hq, 1, D), not {queries.shape}")
    return _paged(queries, k_pool, v_pool, block_tables, context_lens, scale)


def paged_prefill(queries: mx.array, k_pool: mx.array | QuantizedBlocks,
                  v_pool: mx.array | QuantizedBlocks, block_tables: mx.array,
                  context_lens: Sequence[int] | mx.array, scale: float) -> mx.array:
    """Causal attention of each sequence's L newest positions (already written to the
    pool) over its blocks: `paged_decode`'s arguments with queries (B, Hq, L, D); query i
    of sequence b sits at position ``context_lens[b] - L + i``.

    Returns:
        (B, Hq, L, D) in the queries' dtype.
    """
    return _paged(queries, k_pool, v_pool, block_tables, context_lens, scale)


def supports(queries: mx.array, k_pool, v_pool) -> bool:
    """Whether `paged_decode` / `paged_prefill` take these shapes and dtypes."""
    B, Hq, L, D = queries.shape
    Hkv = k_pool.shape[0]

    def side_ok(pool) -> bool:
        if isinstance(pool, QuantizedBlocks):
            q = pool.quant
            return (q.bits in QMM_BITS and q.group_size % 32 == 0 and D % q.group_size == 0
                    and pool.scales.dtype in FLOAT_DTYPES and pool.head_dim == D)
        return pool.dtype in FLOAT_DTYPES and pool.shape[3] == D

    return (D % 16 == 0 and Hq % Hkv == 0 and queries.dtype in FLOAT_DTYPES
            and side_ok(k_pool) and side_ok(v_pool) and k_pool.shape[:3] == v_pool.shape[:3])
