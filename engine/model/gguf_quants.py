"""GGUF tensor blocks to MLX affine weights (packed uint32, scales, biases), in numpy.

Every block type kvchat reads becomes MLX's affine layout, which the CPU extension's tiled
`qmm` and MLX's own kernels compute. Exact where the block format is affine per 32 weights:
- Q4_0, Q4_1, Q4_K -> 4 bits, group 32 (Q4_K: scale d*sc, bias -dmin*m per sub-block);
- Q5_0, Q5_1, Q5_K -> 5 bits, group 32 (the tiled matmul's bit planes, `cpu_ext.bit_planes`);
- Q8_0 -> 8 bits, group 32.
Scales and biases are float16, so d*sc rounds to float16 (relative error <= 2^-11, far
below the 4/5-bit step). Q6_K has one scale per 16 weights, which MLX's groups (32+) cannot
hold: it is re-quantized to 6 bits per 32, each group the better of its min/max fit and its
larger half's own Q6_K step (that half exact); its cost is measured in the README. Block
layouts: ggml-quants.c / gguf-py's quants.py.
"""

from __future__ import annotations

import numpy as np

from engine.errors import ModelLoadError

GROUP = 32
QK_K = 256
# name -> (weights per block, bytes per block)
BLOCKS = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24),
          "Q8_0": (32, 34), "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)}
FLOATS = ("F32", "F16", "BF16")
CHUNK_WEIGHTS = 1 << 22  # weights converted at a time (16 MB as float32)
SUPPORTED = FLOATS + tuple(BLOCKS)


def _f16(raw: np.ndarray) -> np.ndarray:
    """(nb, 2) uint8 -> (nb,) float32 from little-endian float16."""
    return np.ascontiguousarray(raw).view(np.float16)[:, 0].astype(np.float32)


def _pack(q: np.ndarray, bits: int, rows: int) -> np.ndarray:
    """Codes (rows * K,) in 0..2^bits-1 -> (rows, K * bits / 32) uint32 in MLX's order
    (code k in bits [bits * (k % per), ...) of word k // per, low bits first)."""
    q = q.astype(np.uint8).reshape(rows, -1)
    if bits == 4:
        q = q[:, 0::2] | (q[:, 1::2] << 4)
    elif bits != 8:  # one little-endian bit stream, as `mx.quantize` packs 5 and 6 bits
        stream = (q[:, :, None] >> np.arange(bits, dtype=np.uint8)) & 1
        q = np.packbits(stream.reshape(rows, -1), axis=1, bitorder="little")
    return np.ascontiguousarray(q).view(np.uint32)


def _nibbles32(qs: np.ndarray) -> np.ndarray:
    """Q4_0/Q5_0-style (nb, 16) bytes -> (nb, 32): low nibbles are weights 0-15, high 16-31."""
    return np.concatenate([qs & 0xF, qs >> 4], axis=1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """(nb, 4) bytes of a little-endian uint32 -> (nb, 32) bit j of it."""
    word = np.ascontiguousarray(qh).view(np.uint32)[:, 0]
    return ((word[:, None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def _k_scales(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 packed bytes -> (nb, 8) 6-bit scales and mins (get_scale_min_k4)."""
    sc = sc.astype(np.uint8)
    lo_s, lo_m = sc[:, 0:4] & 63, sc[:, 4:8] & 63
    hi_s = (sc[:, 8:12] & 0xF) | ((sc[:, 0:4] >> 6) << 4)
    hi_m = (sc[:, 8:12] >> 4) | ((sc[:, 4:8] >> 6) << 4)
    return (np.concatenate([lo_s, hi_s], 1).astype(np.float32),
            np.concatenate([lo_m, hi_m], 1).astype(np.float32))


def _affine(kind: str, b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Blocks (nb, bytes) -> codes (nb, weights), scales and biases (nb, weights / 32), bits."""
    if kind in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        d = _f16(b[:, 0:2])
        off = 4 if kind.endswith("_1") else 2
        m = _f16(b[:, 2:4]) if kind.endswith("_1") else None
        q = _nibbles32(b[:, -16:])
        if kind.startswith("Q5"):
            q = q | (_high_bits(b[:, off:off + 4]) << 4)
        bits = 4 if kind.startswith("Q4") else 5
        bias = m if m is not None else -d * (8 if bits == 4 else 16)
        return q, d[:, None], bias[:, None], bits
    if kind == "Q8_0":
        d = _f16(b[:, 0:2])
        q = (b[:, 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return q, d[:, None], (-128 * d)[:, None], 8
    if kind in ("Q4_K", "Q5_K"):
        d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
        sc, mn = _k_scales(b[:, 4:16])
        ql = b[:, -128:].reshape(-1, 4, 32)  # 4 chunks of 64 weights: low then high nibbles
        q = np.stack([ql & 0xF, ql >> 4], axis=2).reshape(-1, 8, 32)  # (nb, sub-block, 32)
        if kind == "Q5_K":
            qh = b[:, 16:48]  # bit s of byte l: weight l of sub-block s
            q = q | (((qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1) << 4)
        return q.reshape(-1, QK_K), d[:, None] * sc, -(dmin[:, None] * mn), (
            4 if kind == "Q4_K" else 5)
    raise ModelLoadError(f"no affine form for {kind}")


def _requantize6(w: np.ndarray, sub: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q6_K weights (rows, K), dequantized, with each 16 weights' step ``sub`` (rows, K / 16)
    -> 6-bit group-32 codes, float16 scales and biases. Per group, the better (least squares)
    of two fits: the group's min/max over 63 steps (`mx.quantize`'s), or the larger half's
    own step and zero point (that half then exact, Q6_K's codes as they are)."""
    rows = w.shape[0]
    g = w.astype(np.float32).reshape(rows, -1, GROUP)
    lo, hi = g.min(-1), g.max(-1)
    fits = [(lo, (hi - lo) / 63)]
    halves = np.abs(sub.reshape(rows, -1, 2))
    step = halves.max(-1)
    fits.append((-32 * step, step))
    best_q = best_s = best_b = best_err = None
    for bias, scale in fits:
        scale = scale.astype(np.float16).astype(np.float32)
        bias = bias.astype(np.float16).astype(np.float32)
        safe = np.where(scale == 0, 1, scale)
        q = np.clip(np.rint((g - bias[..., None]) / safe[..., None]), 0, 63)
        err = ((q * scale[..., None] + bias[..., None] - g) ** 2).sum(-1)
        if best_err is None:
            best_q, best_s, best_b, best_err = q, scale, bias, err
            continue
        better = err < best_err
        best_q = np.where(better[..., None], q, best_q)
        best_s, best_b = np.where(better, scale, best_s), np.where(better, bias, best_b)
        best_err = np.minimum(err, best_err)
    return best_q, best_s, best_b


def to_affine(kind: str, data: np.ndarray, shape: tuple[int, int]
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """One quantized GGUF matrix as MLX affine arrays.

    Args:
        kind: the GGML type's name (a key of `BLOCKS`).
        data: the tensor's bytes (any shape; read in order).
        shape: (rows, columns) of the matrix (columns a multiple of the block size).

    Returns:
        (weight uint32 (rows, columns * bits / 32), scales float16, biases float16
        (rows, columns / 32), bits).
    """
    per, nbytes = BLOCKS[kind]
    rows, cols = shape
    raw = np.asarray(data).reshape(-1).view(np.uint8)
    if cols % per or raw.size != rows * cols // per * nbytes:
        raise ModelLoadError(f"{kind} tensor of shape {shape} has {raw.size} bytes")
    blocks = raw.reshape(rows, cols // per * nbytes)
    bits = {"Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "Q8_0": 8}.get(kind, 6 if kind == "Q6_K" else 5)
    w = np.empty((rows, cols * bits // 32), np.uint32)
    scales = np.empty((rows, cols // GROUP), np.float16)
    biases = np.empty_like(scales)
    # Rows at a time: a block's intermediates (codes as bytes, Q6_K as float32) are several
    # times its size, and a whole embedding's would be most of a conversion's peak memory.
    step = max(1, CHUNK_WEIGHTS // cols)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        w[r0:r1], scales[r0:r1], biases[r0:r1] = _rows_affine(kind, blocks[r0:r1], r1 - r0,
                                                              cols, bits)
    return w, scales, biases, bits


def k_steps(kind: str, data: np.ndarray, shape: tuple[int, int]
            ) -> tuple[np.ndarray, np.ndarray] | None:
    """A Q4_K/Q5_K matrix's float16 steps per 256 weights, (rows, columns / 256) each: d,
    of which each scale of `to_affine` is d x sc, and -dmin, of which each bias is -dmin x m
    (sc, m < 64), both before rounding to float16. The tiled matmul keeps the codes and these
    steps instead of float16 scales and biases (`cpu_ext.kquant`): 0.625 bits a weight, not
    1. None for other kinds."""
    if kind not in ("Q4_K", "Q5_K"):
        return None
    rows, cols = shape
    blocks = np.asarray(data).reshape(-1).view(np.uint8).reshape(-1, BLOCKS[kind][1])
    d, dmin = (_f16(blocks[:, a:a + 2]).astype(np.float16) for a in (0, 2))  # exact
    return d.reshape(rows, cols // QK_K), (-dmin).reshape(rows, cols // QK_K)


def _rows_affine(kind: str, raw: np.ndarray, rows: int, cols: int, bits: int
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`to_affine` of whole rows (``raw``: their blocks, (rows, bytes per row))."""
    blocks = raw.reshape(-1, BLOCKS[kind][1])
    if kind == "Q6_K":
        from gguf import GGMLQuantizationType, quants

        w = quants.dequantize(blocks, GGMLQuantizationType.Q6_K).reshape(rows, cols)
        sub = blocks[:, 192:208].view(np.int8).astype(np.float32) * _f16(blocks[:, 208:210])[
            :, None]  # each 16 weights' step, natural order
        q, scale, bias = _requantize6(w, sub.reshape(rows, -1))
    else:
        q, scale, bias, _ = _affine(kind, blocks)  # its bits are `to_affine`'s
    scales = np.asarray(scale, np.float32).reshape(rows, cols // GROUP).astype(np.float16)
    biases = np.asarray(bias, np.float32).reshape(rows, cols // GROUP).astype(np.float16)
    return _pack(np.asarray(q).reshape(-1), bits, rows), scales, biases
