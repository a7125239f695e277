"""Quantized linears that run on the extension's `qmm` (the CPU fast path).

`install(model)` swaps every supported `nn.QuantizedLinear` for a `CpuQuantizedLinear`
and a quantized embedding for a `CpuQuantizedEmbedding` (its ``as_linear``, the tied
output projection, then runs on `qmm` too). Both subclass MLX's classes and keep the
same parameters, so mlx-lm code that checks or walks the model still works, and
mlx-lm's own forward (the parity reference) runs the fast path as well.
"""

from __future__ import annotations

import math
import os

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from engine.model.cpu_ext import bit_planes, kquant, ops


def supported(layer: nn.Module, bits: tuple[int, ...] = ops.QMM_BITS) -> bool:
    """A quantized layer `qmm` computes: affine mode, 4/8 bits (or ``bits``), group
    32/64/128."""
    return (
        isinstance(layer, (nn.QuantizedLinear, nn.QuantizedEmbedding))
        and getattr(layer, "mode", "affine") == "affine"
        and layer.bits in bits
        and layer.group_size in ops.QMM_GROUP_SIZES
        and layer.get("biases") is not None
        and layer["scales"].dtype in ops.FLOAT_DTYPES
    )


def rebind(cls, layer: nn.Module) -> nn.Module:
    """A `cls` instance (a subclass of ``type(layer)``) sharing `layer`'s parameters and
    settings: no re-quantizing, no new weights."""
    new = cls.__new__(cls)
    nn.Module.__init__(new)
    new.__dict__.update(layer.__dict__)
    for key, value in layer.items():
        new[key] = value
    return new


def rebind_layout(cls, layer: nn.Module, steps: tuple | None = None) -> nn.Module:
    """`rebind`; for a ``cls.tiled`` class, with the weight, scales and biases re-laid by
    `ops.tile` (new arrays: the layer's own are freed with it). Biases that are all one
    factor times their scales (`bias_factor`) become that (1, 1) factor: a symmetric file
    (GGUF Q4_0, Q8_0) then holds no biases, ~1/9 of a 4-bit layer's bytes. With a GGUF
    K-quant layer's ``steps`` (scales and biases steps), scales and biases become its codes
    and steps where they are exactly that (`kquant.compact`), 0.625 bits a weight not 1."""
    new = rebind(cls, layer)
    compact = kquant.compact(layer["scales"], layer["biases"], *steps) if cls.tiled and steps \
        else None
    if compact:
        new["weight"] = ops.tile(layer["weight"], layer["scales"], layer["biases"],
                                 layer.group_size, layer.bits)[0]
        new["scales"], new["biases"] = compact
        mx.eval(new["weight"])
    elif cls.tiled:
        factor = bias_factor(layer)
        biases = layer["biases"] if factor is None else mx.full(
            (1, 1), factor, dtype=layer["scales"].dtype)
        new["weight"], new["scales"], new["biases"] = ops.tile(
            layer["weight"], layer["scales"], biases, layer.group_size, layer.bits)
        mx.eval(new["weight"], new["scales"], new["biases"])
    return new


def bias_factor(layer: nn.Module) -> float | None:
    """f = -2^k with every bias equal to f times its scale (a symmetric format: GGUF Q4_0's
    -8, Q8_0's -128, Q5_0's -16 as 8-bit codes), else None. A power of two, so f times a
    scale is exact in any float dtype and the tiled kernels' results stay bit for bit."""
    scales, biases = layer["scales"], layer["biases"]
    if biases.shape != scales.shape or scales.size == 0:
        return None
    s32, b32 = scales.astype(mx.float32), biases.astype(mx.float32)
    i = mx.argmax(mx.abs(s32).reshape(-1)).item()
    s0, b0 = s32.reshape(-1)[i].item(), b32.reshape(-1)[i].item()
    if s0 == 0 or b0 / s0 >= 0:  # Q4_0's scales take the sign of the group's extreme
        return None
    factor = b0 / s0
    if not math.isfinite(factor):  # an overflowed or NaN bias (a damaged file): keep them
        return None
    k = round(math.log2(-factor))
    if factor != -(2.0 ** k) or not mx.array_equal(b32, s32 * factor).item():
        return None
    return factor


class CpuQuantizedLinear(nn.QuantizedLinear):
    """`nn.QuantizedLinear` whose forward is the extension's `qmm`."""

    tiled = False  # parameters in `ops.tile`'s layout (`CpuTiledLinear`)

    @classmethod
    def from_quantized(cls, layer: nn.QuantizedLinear, steps: tuple | None = None
                       ) -> CpuQuantizedLinear:
        return rebind_layout(cls, layer, steps)

    def __call__(self, x: mx.array) -> mx.array:
        y = ops.qmm(x, self["weight"], self["scales"], self["biases"],
                    group_size=self.group_size, bits=self.bits, tiled=self.tiled)
        return y + self["bias"] if "bias" in self else y


def linear_args(module) -> tuple[list[mx.array], tuple[int, int, bool]] | None:
    """A fused layer op's arguments for ``module``: ([w, scales, biases], (group, bits,
    tiled)) of a `CpuQuantizedLinear` without a bias; None for any other module."""
    if not isinstance(module, CpuQuantizedLinear) or "bias" in module:
        return None
    return ([module["weight"], module["scales"], module["biases"]],
            (module.group_size, module.bits, module.tiled))


class CpuTiledLinear(CpuQuantizedLinear):
    """A `CpuQuantizedLinear` whose weight, scales and biases are in `ops.tile`'s
    layout, multiplied with x quantized to int16 per group in exact integer dot products
    (AVX-512 VNNI): several times fewer instructions per weight than dequantizing to float,
    at about float16's precision. Its parameters are not MLX's layout: only `qmm` reads them.
    """

    tiled = True


def tileable(layer: nn.Module) -> bool:
    """A supported linear or embedding the tiled classes can take: rows in 16s, groups of
    32s, 4, 5, 6 or 8 bits."""
    kind = type(layer) in (nn.QuantizedLinear, nn.QuantizedEmbedding)
    return (kind and supported(layer, ops.TILED_BITS)
            and layer["weight"].shape[0] % ops.TILE_ROWS == 0
            and layer.group_size % 32 == 0)


def tiled_enabled() -> bool:
    """The tiled path is built in and not turned off (``KVCHAT_TILED=0``)."""
    return os.environ.get("KVCHAT_TILED", "1") != "0" and ops.tiled_supported()


class CpuQuantizedEmbedding(nn.QuantizedEmbedding):
    """`nn.QuantizedEmbedding` whose ``as_linear`` (tied output head) is `qmm`."""

    tiled = False  # parameters in `ops.tile`'s layout (`CpuTiledEmbedding`)

    @classmethod
    def from_quantized(cls, layer: nn.QuantizedEmbedding) -> CpuQuantizedEmbedding:
        return rebind_layout(cls, layer)

    def as_linear(self, x: mx.array) -> mx.array:
        return ops.qmm(x, self["weight"], self["scales"], self["biases"],
                       group_size=self.group_size, bits=self.bits, tiled=self.tiled)


class CpuTiledEmbedding(CpuQuantizedEmbedding):
    """A 4/5/6/8-bit `CpuQuantizedEmbedding` in `ops.tile`'s layout: ``as_linear`` (the
    tied output head, the largest matmul of a small model) runs the tiled `qmm`, and a
    lookup gathers only its rows' bytes and dequantizes them as MLX does (`ops.lookup_rows`)."""

    tiled = True

    def __call__(self, x: mx.array) -> mx.array:
        return ops.lookup_rows(self["weight"], self["scales"], self["biases"], x,
                               self.group_size, self.bits)


def install(model: nn.Module, *, tiled: bool = False,
            steps: dict[str, mx.array] | None = None) -> int:
    """Swap the supported quantized layers of `model` in place; returns how many.

    With ``tiled``, the layers that fit the tiled layout become `CpuTiledLinear` /
    `CpuTiledEmbedding`; a linear named in ``steps`` (`kquant.load_steps`) keeps its GGUF
    K-quant scales as codes and steps."""
    steps = steps or {}
    count = 0
    # largest first: a layer's re-laid copy and its lazily loaded source are alive together,
    # and the embedding's pair is the peak only while the rest is not yet loaded
    modules = sorted(model.named_modules(), key=lambda nm: -_weight_bytes(nm[1]))
    for name, module in modules:
        if tiled and tileable(module):
            if isinstance(module, nn.QuantizedLinear):
                new = CpuTiledLinear.from_quantized(module, (steps.get(f"{name}.scales_step"),
                                                             steps.get(f"{name}.biases_step")))
            else:
                new = CpuTiledEmbedding.from_quantized(module)
        elif type(module) in (nn.QuantizedLinear, nn.QuantizedEmbedding) and supported(
                module, ops.TILED_BITS):
            cls = CpuQuantizedLinear if isinstance(module, nn.QuantizedLinear) \
                else CpuQuantizedEmbedding
            new = cls.from_quantized(widened(module))
        else:
            continue
        # the old arrays are dropped when the new layer holds copies (re-laid or widened)
        replace_layer(model, name, module, new, drop_old=new["weight"] is not module["weight"])
        count += 1
    return count


def widened(layer: nn.Module) -> nn.Module:
    """``layer`` itself, or for 5/6 bits (which only the tiled path reads) the same layer
    with its codes in 8 bits: same scales and biases, so the same weights."""
    if layer.bits not in bit_planes.BITS:
        return layer
    new = rebind(type(layer), layer)
    new["weight"] = bit_planes.widen_to_8(layer["weight"], layer.bits)
    new.bits = 8
    mx.eval(new["weight"])
    return new


def _weight_bytes(module: nn.Module) -> int:
    w = module.get("weight") if isinstance(module, nn.Module) else None
    return w.nbytes if isinstance(w, mx.array) else 0


def replace_layer(model: nn.Module, name: str, old: nn.Module, new: nn.Module, *,
                  drop_old: bool) -> None:
    """Put ``new`` at ``name`` in ``model``; with ``drop_old`` (``new`` holds re-laid copies,
    not ``old``'s arrays) free ``old``'s weight, scales and biases at once. Swapping one
    layer at a time this way, the model's weights are never held twice at the peak."""
    model.update_modules(tree_unflatten([(name, new)]))
    if drop_old:
        for key in ("weight", "scales", "biases"):
            old.pop(key, None)


def scaled_biases(layer: nn.Module) -> bool:
    """Whether ``layer`` holds a (1, 1) bias factor (`bias_factor`) instead of biases."""
    return layer["biases"].size == 1 and layer["biases"].shape != layer["scales"].shape


def fuse(layers: list[nn.Module]) -> CpuQuantizedLinear | None:
    """One `CpuQuantizedLinear` computing ``layers`` side by side (outputs concatenated).

    Their packed rows, scales, biases (and bias) are concatenated, and each layer is
    re-pointed at its slice, so the weights are not held twice. Each output row is the
    same computation either way (`qmm` works row by row), so results are unchanged.
    None unless all are `CpuQuantizedLinear` (or all `CpuTiledLinear`: their tiles stack)
    with one bit width, group size and input width.
    """
    if not layers or type(layers[0]) not in (CpuQuantizedLinear, CpuTiledLinear) or not all(
            type(m) is type(layers[0]) for m in layers):
        return None
    first = layers[0]
    same = all(m.bits == first.bits and m.group_size == first.group_size
               and m["weight"].shape[1] == first["weight"].shape[1]
               and m["scales"].dtype == first["scales"].dtype for m in layers)
    has_bias = ["bias" in m for m in layers]
    if not same or (any(has_bias) and not all(has_bias)):
        return None
    factors = [m["biases"] for m in layers if scaled_biases(m)]
    if factors and (len(factors) < len(layers) or not all(
            mx.array_equal(f, factors[0]).item() for f in factors)):
        return None  # one fused matmul has one kind of biases
    names = ["weight", "scales"] + ([] if factors else ["biases"])
    names += ["bias"] if all(has_bias) else []
    fused = rebind(type(first), first)
    splits, total = [], 0
    for m in layers[:-1]:
        total += m["weight"].shape[0]
        splits.append(total)
    for key in names:
        fused[key] = mx.concatenate([m[key] for m in layers])
        for m, part in zip(layers, mx.split(fused[key], splits), strict=True):
            m[key] = part
    return fused


class QkvParts(nn.Module):
    """q, k and v projections that cannot be one matmul (a K-quant file's v often has other
    bits than q and k), computed side by side: ``layer_ops`` runs them inside one layer
    head op, and the runner's fused path calls this (outputs concatenated)."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        self.parts = parts

    @classmethod
    def of(cls, layers: list[nn.Module]) -> QkvParts | None:
        """None unless all are the extension's quantized linears without a bias, of one
        group size, input width and scales dtype, tiled or not alike."""
        first = layers[0]
        if not all(isinstance(m, CpuQuantizedLinear) and type(m).tiled == type(first).tiled
                   and "bias" not in m and m.group_size == first.group_size
                   and m["weight"].shape[1] * 32 // m.bits
                   == first["weight"].shape[1] * 32 // first.bits
                   and kquant.param_dtype(m["scales"]) == kquant.param_dtype(first["scales"])
                   for m in layers):
            return None
        return cls(list(layers))

    def __call__(self, x: mx.array) -> mx.array:
        return mx.concatenate([m(x) for m in self.parts], axis=-1)
