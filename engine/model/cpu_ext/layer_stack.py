"""A decode step's extension layers as one C++ call (csrc/layer_stack.h).

The runner builds each layer's four nodes (`ExtLayer.head`, the K/V writes, paged
attention, `ExtLayer.tail`) in Python at ~50 us a layer: ~1.5 ms of a ~12 ms decode
step of the default model, with both cores idle meanwhile. `LayerStack.run` builds the
same nodes, by the same C++ functions with the same arguments, in one call, so the
outputs are the same bits. It applies where that graph is the whole story: every layer
an `ExtLayer` with plain attention (no window, no sinks), float pools (not quantized,
not windowed) written by the extension, and the attention route's CPU kernel, already
validated by the guard (`attention.validated_kernel`). ``KVCHAT_LAYER_STACK=0`` turns it
off (to compare).
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from engine.model import backend
from engine.model.attention.spec import AttentionSpec
from engine.model.cpu_ext import build
from engine.model.cpu_ext.layer_ops import ExtLayer


def enabled() -> bool:
    """False when ``KVCHAT_LAYER_STACK`` says off."""
    return not backend.switched_off("KVCHAT_LAYER_STACK")


class LayerStack:
    """The C++ stack of a model's `ExtLayer`s for one block size."""

    def __init__(self, layers: Sequence[ExtLayer], specs: Sequence[AttentionSpec],
                 block_size: int):
        first = layers[0]
        self.block_size = block_size
        self._stack = build.require().LayerStack(first.heads, first.kv_heads, block_size)
        for layer, spec in zip(layers, specs, strict=True):
            (nw, neps), (pw, peps), r = layer.input_norm, layer.post_norm, layer.rope
            self._stack.add(
                nw, neps, [a for wsb, _ in layer.qkv for a in wsb],
                [spec for _, spec in layer.qkv], r.dims, r.traditional, r.base, r.scale,
                getattr(r, "freqs", None), layer.o[0], layer.o[1], pw, peps,
                layer.gate_up[0], layer.gate_up[1], layer.down[0], layer.down[1],
                float(spec.scale))

    @staticmethod
    def applies(layers: Sequence[ExtLayer | None], specs: Sequence[AttentionSpec]) -> bool:
        """Every layer an `ExtLayer` of one head layout with plain attention."""
        return (bool(layers) and all(x is not None for x in layers)
                and all(s.plain for s in specs)
                and len({(x.heads, x.kv_heads) for x in layers}) == 1)

    def run(self, h: mx.array, keys: list, values: list, first: int, slots: mx.array,
            block_tables: mx.array, context_lens: mx.array, offsets: mx.array) -> mx.array:
        """Layers ``first``.. of ``h``: writes their new pools into ``keys``/``values``
        (every layer's, indexed by layer) and returns the last layer's output."""
        out, new_k, new_v = self._stack.run(
            h, keys[first:], values[first:], slots.astype(mx.int32),
            block_tables.astype(mx.int32), context_lens, offsets, first)
        keys[first:], values[first:] = new_k, new_v
        return out


def stacked(runner, h: mx.array, q0: mx.array, batch, kv) -> mx.array | None:
    """Layers 1.. of ``runner``'s decode step (`model_runner.StepBatch`) through its
    `LayerStack`, given layer 0's output ``h`` and queries ``q0``; None where the stack
    does not apply (the runner then builds them one by one)."""
    from engine.model.attention import validated_kernel
    from engine.model.attention.cpu import lens_array
    from engine.model.cpu_ext.norm_rope import offsets_array
    from engine.model.cpu_ext.ops import kv_write

    layout = kv.layout
    if (len(runner.layers) < 2 or not runner.use_kernels or not enabled()
            or layout.k_quant is not None or layout.v_quant is not None
            or any(kv.windowed) or kv.row_writer is not kv_write):
        return None
    k_pool, v_pool = kv.block_view(0)
    if validated_kernel(q0, k_pool, v_pool, batch.block_tables, batch.context_lens,
                        runner.attention[0]) != "cpu":
        return None  # the route, the guard or a failure says otherwise: the usual build
    stack = runner.stacks.get(layout.block_size)
    if stack is None:
        stack = runner.stacks[layout.block_size] = LayerStack(
            runner.ext, runner.attention, layout.block_size)
    return stack.run(h, kv.keys, kv.values, 1, batch.slots, batch.block_tables,
                     lens_array(batch.context_lens),
                     offsets_array(runner._offset(batch, h.shape[1])))
