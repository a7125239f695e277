"""The rotation applied to K and V rows before they are quantized (`QuantSpec.rotation`).

A key row of this model family carries a few outlier channels ~100x the others; one scale
per group then spends nearly every quantization level on them, and the other channels
round to a handful of values. An orthonormal rotation spreads each outlier over the whole
block, so the group's range shrinks and the rest keep their precision (QuaRot; llama.cpp
rotates its quantized KV the same way). Attention is unchanged in exact arithmetic: keys
stored as ``k R`` meet queries rotated alike, ``(q R)(k R)^T = q k^T``, and values stored
as ``v R`` give ``o R``, rotated back by ``R^T``.

``R`` for rotation 1: block-diagonal, each block ``diag(s) H / sqrt(n)`` with H the
Sylvester Hadamard matrix of the largest power of two n dividing the head dim and s a
fixed sign pattern (random-looking signs break up outliers that align with H's rows). The
signs come from a fixed integer hash, never from a random generator whose stream could
change between library versions: stored entries must rotate back the same way forever.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx
import numpy as np

from engine.kvcache.quant import rotation_block


def _signs(n: int) -> np.ndarray:
    """+-1 from bit 32 of SplitMix64 (seed 0) of each index: fixed, well mixed."""
    mask, out = (1 << 64) - 1, []
    for i in range(n):
        z = (i + 1) * 0x9E3779B97F4A7C15 & mask
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & mask
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB & mask
        out.append(-1.0 if ((z ^ (z >> 31)) >> 32) & 1 else 1.0)
    return np.array(out)


@lru_cache(maxsize=8)
def _matrix(head_dim: int) -> mx.array:
    n = rotation_block(head_dim)
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    block = _signs(n)[:, None] * h / np.sqrt(n)
    full = np.kron(np.eye(head_dim // n), block)
    m = mx.array(full.astype(np.float32))
    mx.eval(m)
    return m


@lru_cache(maxsize=8)
def signs(head_dim: int) -> mx.array:
    """The sign of each row of R's blocks, (head_dim,) float32: with the blocks' width
    (`rotation_block`), all a fast Walsh-Hadamard transform needs to apply R."""
    n = rotation_block(head_dim)
    s = mx.array(np.tile(_signs(n), head_dim // n).astype(np.float32))
    mx.eval(s)
    return s


def matrix(head_dim: int) -> mx.array:
    """R (head_dim, head_dim), float32, orthonormal."""
    return _matrix(head_dim)


def _extension():
    """The CPU extension's one-op rotation when MLX computes on the CPU and it is built."""
    if mx.default_device() != mx.cpu:
        return None
    from engine.model.cpu_ext import build  # lazily: the extension sits above the pool

    return build.load()


def rotate(rows: mx.array) -> mx.array:
    """``rows @ R`` over the last axis, in float32, returned in the rows' dtype: one op of
    the CPU extension where it runs (a fast Walsh-Hadamard transform), else a GEMM."""
    ext = _extension()
    if ext is not None:
        return ext.hadamard(rows, signs(rows.shape[-1]))
    return (rows.astype(mx.float32) @ matrix(rows.shape[-1])).astype(rows.dtype)


@lru_cache(maxsize=8)
def _transposed(head_dim: int) -> mx.array:
    t = mx.array(np.array(_matrix(head_dim)).T)  # materialized: no transpose node per call
    mx.eval(t)
    return t


def unrotate(rows: mx.array) -> mx.array:
    """``rows @ R^T``: undoes `rotate`."""
    ext = _extension()
    if ext is not None:
        return ext.hadamard(rows, signs(rows.shape[-1]), inverse=True)
    return (rows.astype(mx.float32) @ _transposed(rows.shape[-1])).astype(rows.dtype)
