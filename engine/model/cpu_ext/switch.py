"""MoE expert matmuls on the extension's tiled `qmm` (mlx-lm's `QuantizedSwitchLinear`).

mlx-lm computes routed experts with `mx.gather_qmm`, MLX's slow CPU quantized kernel. Here
each expert's weights are tiled once at load (`ops.tile`, stacked as (experts, rows, ...)),
and a call is one extension op (`switch_qmm`) that reads the routing inside its task,
groups the rows by expert and runs the tiled `qmm` of each expert in use: each output row
is its expert's, as a dense linear computes it. (A first version grouped the rows on the
host: a sync and ~30 nodes per call, three calls a layer.)
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from engine.model.cpu_ext import build, kquant, ops
from engine.model.cpu_ext.linear import rebind, replace_layer


def switch_supported(layer: nn.Module) -> bool:
    """An mlx-lm `QuantizedSwitchLinear` the tiled `qmm` computes per expert (4, 5, 6 or 8
    bits: a GGUF Q4_K_M's Q6_K ``ffn_down_exps`` too)."""
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear

    return (type(layer) is QuantizedSwitchLinear
            and getattr(layer, "mode", "affine") == "affine"
            and layer.bits in ops.TILED_BITS and layer.group_size in ops.QMM_GROUP_SIZES
            and layer.group_size % 32 == 0 and layer.get("biases") is not None
            and layer["weight"].shape[1] % ops.TILE_ROWS == 0
            and layer["scales"].dtype in ops.FLOAT_DTYPES)


def _switch_base():
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear

    return QuantizedSwitchLinear


class CpuTiledSwitchLinear(_switch_base()):
    """`QuantizedSwitchLinear` with each expert in `ops.tile`'s layout; only `qmm` reads
    them."""

    @classmethod
    def from_quantized(cls, layer, steps: tuple | None = None) -> CpuTiledSwitchLinear:
        """The tiled experts of ``layer``; with GGUF K-quant ``steps`` (scales and biases
        steps, (experts, rows, columns / 256)), scales and biases as codes and steps where
        they are exactly that (`kquant.compact`)."""
        new = rebind(cls, layer)
        # every expert in one call: tiles are 16 rows, so the stacked experts' rows tile as
        # each expert's would
        keys = ("weight", "scales", "biases")
        rows = [layer[k].reshape(-1, layer[k].shape[-1]) for k in keys]
        flat = [s.reshape(-1, s.shape[-1]) if s is not None else None for s in steps or ()]
        compact = kquant.compact(rows[1], rows[2], *flat) if flat else None
        for key, tiled in zip(keys, ops.tile(*rows, layer.group_size, layer.bits), strict=True):
            if compact and key != "weight":
                tiled = compact[key == "biases"]
            new[key] = tiled.reshape(*layer[key].shape[:-1], tiled.shape[-1])
            mx.eval(new[key])
        return new

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False):
        # x (..., 1 or k, 1, D) against indices (..., k) -> (..., k, 1, N), as gather_qmm
        shape = indices.shape
        D = x.shape[-1]
        if x.shape[:-2] not in (shape, (*shape[:-1], 1)):  # other broadcasts: made explicit
            x = mx.broadcast_to(x, (*shape, 1, D))
        ids = indices.reshape(-1)
        y = build.require().switch_qmm(
            x.reshape(-1, D), self["weight"], self["scales"], self["biases"],
            ids if ids.dtype == mx.int32 else ids.astype(mx.int32),
            group_size=self.group_size, bits=self.bits)
        if "bias" in self:
            y = y + self["bias"][ids]
        return y.reshape(*shape, 1, y.shape[-1])


def install(model: nn.Module, steps: dict[str, mx.array] | None = None) -> int:
    """Swap every supported `QuantizedSwitchLinear` of ``model`` for a
    `CpuTiledSwitchLinear`, one at a time (the untiled experts dropped at once); returns
    how many. Those named in ``steps`` (`kquant.load_steps`) keep K-quant codes."""
    count = 0
    steps = steps or {}
    for name, module in model.named_modules():
        if switch_supported(module):
            pair = (steps.get(f"{name}.scales_step"), steps.get(f"{name}.biases_step"))
            replace_layer(model, name, module, CpuTiledSwitchLinear.from_quantized(module, pair),
                          drop_old=True)
            count += 1
    return count
