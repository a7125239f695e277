"""RMSNorm and RoPE layers that run as one extension op each (the CPU fast path).

On the CPU backend MLX builds `mx.fast.rms_norm` and `mx.fast.rope` from their
fallbacks: about 11 and 34 dispatched ops. With two norms and two rotary embeddings
per layer that was over half of a decode step's graph (~2,000 of ~3,750 ops for the
default model) at ~5 us of dispatch each. `install(model)` swaps plain `nn.RMSNorm`
and `nn.RoPE` modules for subclasses that call the extension; other RoPE variants
(scaled, YaRN, Llama 3) keep MLX's own.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from engine.model.cpu_ext import build
from engine.model.cpu_ext.linear import rebind


def _ext():
    module = build.load()
    if module is None:
        raise RuntimeError(f"the CPU extension is unavailable: {build.unavailable_reason()}")
    return module


def rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    """`mx.fast.rms_norm` as one op: float32 math, result in the promoted dtype."""
    return _ext().rms_norm(x, weight, eps=eps)


def rope(x: mx.array, *, dims: int, traditional: bool, base: float, scale: float,
         offset: int | mx.array) -> mx.array:
    """`mx.fast.rope` of (B, H, L, D) as one op; ``offset`` an int or one per batch row."""
    if not isinstance(offset, mx.array):
        offset = mx.array([int(offset)], dtype=mx.int32)
    elif offset.dtype != mx.int32 or offset.ndim == 0:
        offset = offset.astype(mx.int32).reshape(-1)
    return _ext().rope(x, offset, dims=dims, traditional=traditional, base=base, scale=scale)


def swiglu(gate: mx.array, up: mx.array) -> mx.array:
    """mlx-lm's ``swiglu(gate, up)`` (silu(gate) * up) as one op, float32 math.

    MLX's CPU sigmoid is scalar (~30 ns an element here), and mlx-lm's swiglu runs as
    three ops once mx.compile is off: 23 ms per 512-token chunk of the default model's
    MLP against 1 ms for this.
    """
    return _ext().swiglu(gate, up)


class CpuRMSNorm(nn.RMSNorm):
    """`nn.RMSNorm` computed by the extension in one op."""

    def __call__(self, x: mx.array) -> mx.array:
        return rms_norm(x, self["weight"], self.eps)


class CpuRoPE(nn.RoPE):
    """`nn.RoPE` computed by the extension in one op (4-d inputs; others: MLX's own)."""

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        if x.ndim != 4:
            return super().__call__(x, offset)
        return rope(x, dims=self.dims, traditional=self.traditional, base=self.base,
                    scale=self.scale, offset=offset)


def install(model: nn.Module) -> int:
    """Swap plain `nn.RMSNorm` / `nn.RoPE` modules of `model` in place; returns how many."""
    swaps = []
    for name, module in model.named_modules():
        if type(module) is nn.RMSNorm:
            swaps.append((name, rebind(CpuRMSNorm, module)))
        elif type(module) is nn.RoPE and module.base is not None:
            swaps.append((name, rebind(CpuRoPE, module)))
    if swaps:
        model.update_modules(tree_unflatten(swaps))
    return len(swaps)
