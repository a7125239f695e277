"""What the extension's tiled matmul promises, computed in float64: the oracle of
test_cpu_ext_tiled.py (int16 activations) and test_cpu_ext_tiled_int8.py (int8)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np


def quantized(N: int, K: int, group: int, seed: int, bits: int = 4):
    """Random (N, K) weights quantized by MLX, float16 scales and biases."""
    mx.random.seed(seed)
    w, s, b = mx.quantize(mx.random.normal((N, K)), group_size=group, bits=bits)
    return w, s.astype(mx.float16), b.astype(mx.float16)


def promised(x: mx.array, w, s, b, group: int, bits: int, levels: int = 32767) -> np.ndarray:
    """x quantized per group to +-levels (round half to even), exact integer dot products
    with the codes, then scales times x's step, plus biases times a sum of x: x's own sum
    for int16 (qmm_tiled.cpp), the quantized x's for int8 (qmm_tiled_int8.cpp: the
    dequantized weights times the quantized x exactly)."""
    M, K = x.shape
    N = w.shape[0]
    G = K // group
    q = np.array(mx.dequantize(w, mx.ones_like(s), mx.zeros_like(b), group_size=group,
                               bits=bits)).astype(np.float64).reshape(N, G, group)
    xg = np.array(x.astype(mx.float32)).reshape(M, G, group)
    amax = np.abs(xg).max(-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        qx = np.where(amax > 0, np.round(xg * (np.float32(levels) / amax)), 0).astype(np.float64)
    dx = (amax / np.float32(levels)).astype(np.float32).astype(np.float64)[..., 0]
    isum = np.einsum("mgk,ngk->mng", qx, q)
    sn = np.array(s.astype(mx.float32)).astype(np.float64)
    bn = np.array(b.astype(mx.float32)).astype(np.float64)
    xsum = xg.sum(-1) if levels > 127 else (dx * qx.sum(-1)).astype(np.float32)
    return (isum * sn[None] * dx[:, None]).sum(-1) + (bn[None] * xsum[:, None]).sum(-1)
