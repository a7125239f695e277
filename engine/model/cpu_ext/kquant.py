"""GGUF K-quant scales and biases kept as codes and steps on the tiled path.

A Q4_K/Q5_K block's 8 sub-block scales are d x sc and its biases -dmin x m, with sc and m
6-bit codes and d, dmin float16 per 256 weights. The converter writes them as float16 scales
and biases (1 bit a weight at group 32) for MLX; the tiled matmul can instead read the codes
(uint8) and the steps (float16 per 8 groups): 0.625 bits a weight, ~39 MB less for a 1B
Q4_K_M file. The kernel multiplies code x step in float32 (exact) and rounds to float16, the
converter's own rounding, so every scale and bias is the same bits and so is every result;
`compact` checks that bit for bit and keeps the float16 arrays where it does not hold.

Tiled layout (`qmm_tiled_impl.h`'s `kquant_params`): per tile of 16 rows and 8 groups, 160
bytes: the codes of group g % 8, row i at byte 16 (g % 8) + i, then the 16 rows' float16
steps. As an (N, G / 8 * 10) uint8 array, row slices at multiples of 16 stay whole tiles.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from engine.model.gguf import KQUANT_STEPS

STEP_GROUPS = 8  # groups of 32 per step: a K-quant super-block of 256 weights
TILE_ROWS = 16


def load_steps(model_dir: Path) -> dict[str, mx.array]:
    """The converted model's K-quant steps by ``<layer>.scales_step`` / ``.biases_step``
    (loaded lazily, each read when used); empty when the model has none or the file does
    not read (the float16 scales then stay, with the same results)."""
    path = Path(model_dir) / KQUANT_STEPS
    if not path.is_file():
        return {}
    try:
        return dict(mx.load(str(path)))
    except Exception:  # a damaged side file costs memory, never the load
        return {}


def param_dtype(scales: mx.array) -> mx.Dtype:
    """The float dtype a layer's scales stand for: float16 for K-quant codes."""
    return mx.float16 if scales.dtype == mx.uint8 else scales.dtype


def _codes(values: mx.array, step: mx.array) -> mx.array | None:
    """Codes c (uint8) with float16(c x step) == values bit for bit, step per 8 groups; None
    when some value is not one."""
    st = mx.repeat(step.astype(mx.float32), STEP_GROUPS, axis=1)
    codes = mx.clip(mx.round(values.astype(mx.float32) / mx.where(st == 0, 1, st)), 0, 255)
    back = (codes * st).astype(mx.float16)
    if not mx.array_equal(back.view(mx.uint16), values.view(mx.uint16)).item():
        return None
    return codes.astype(mx.uint8)


def _tiled(codes: mx.array, step: mx.array) -> mx.array:
    """Codes (N, G) and steps (N, G / 8) in the tiled layout (the module docstring)."""
    N, G = codes.shape
    T, S = N // TILE_ROWS, G // STEP_GROUPS
    c = codes.reshape(T, TILE_ROWS, S, STEP_GROUPS).transpose(0, 2, 3, 1).reshape(T, S, -1)
    d = mx.contiguous(step.reshape(T, TILE_ROWS, S).transpose(0, 2, 1))
    d = d.view(mx.uint8).reshape(T, S, 2 * TILE_ROWS)
    return mx.concatenate([c, d], axis=2).reshape(N, S * 10)


def compact(scales: mx.array, biases: mx.array, scales_step: mx.array | None,
            biases_step: mx.array | None) -> tuple[mx.array, mx.array] | None:
    """A layer's float16 ``scales`` and ``biases`` (N, G), in MLX's order, as tiled K-quant
    codes and steps (the module docstring), or None: no steps, other shapes or dtypes, or a
    value that is not code x step bit for bit."""
    if scales_step is None or biases_step is None:
        return None
    N, G = scales.shape
    shape = (N, G // STEP_GROUPS)
    if (scales.dtype != mx.float16 or biases.dtype != mx.float16 or biases.shape != (N, G)
            or N % TILE_ROWS or G % STEP_GROUPS or scales_step.shape != shape
            or biases_step.shape != shape or scales_step.dtype != mx.float16
            or biases_step.dtype != mx.float16):
        return None
    try:
        mx.eval(scales_step, biases_step)  # read lazily: a damaged file fails here
    except Exception:
        return None
    out = []
    for values, step in ((scales, scales_step), (biases, biases_step)):
        codes = _codes(values, step)
        if codes is None:
            return None
        out.append(_tiled(codes, step))
    mx.eval(out)
    return out[0], out[1]
