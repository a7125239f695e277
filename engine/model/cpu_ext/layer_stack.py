"""A step's extension layers as one C++ call (csrc/layer_stack.h).

The runner builds each layer's four nodes (`ExtLayer.head`, the K/V writes, paged
attention, `ExtLayer.tail`) in Python at ~50 us a layer: ~1.5 ms of a ~12 ms decode
step of the default model, with both cores idle meanwhile. `LayerStack.run` builds the
same nodes, by the same C++ functions with the same arguments, in one call, so the
outputs are the same bits (a layer's K/V writes are one `kv_write_sides` node in both,
where they were one node per stored array: 29 fewer nodes a step on a float pool, 145 on
a per-token quantized one, 1.5-5 % and 7-13 % faster steps in the README's A/B). It applies
where that graph is the whole story: every layer an `ExtLayer` with plain attention (no
window, no sinks); pools the extension writes, float, quantized per token or residual -kivi
(a residual step that fills a block, and residual prefills, are built layer by layer); and
the attention route's CPU kernel for the call, already validated by the guard
(`attention.validated_kernel`).
``KVCHAT_LAYER_STACK=0`` turns it off (to compare).
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
        self.source = layers  # built from this list: another list means rebuild
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
            block_tables: mx.array, context_lens: mx.array, offsets: mx.array,
            **kv) -> tuple[mx.array, list, list]:
        """Layers ``first``.. of ``h``, each side given per layer as a list of its arrays
        (``kv``: the C++ `StackKV`, float pools by default): (the last layer's output, the
        layers' new keys, their new values) in the same form."""
        return self._stack.run(h, keys, values, slots.astype(mx.int32),
                               block_tables.astype(mx.int32), context_lens, offsets, first,
                               **kv)


def _sides(kv, first: int, kind: int) -> tuple[list, list]:
    """Each layer's K and V arrays from ``first`` on, in the C++ stack's form."""
    if kind == 0:
        return [[a] for a in kv.keys[first:]], [[a] for a in kv.values[first:]]
    if kind == 1:
        return [list(a) for a in kv.keys[first:]], [list(a) for a in kv.values[first:]]
    return ([[*k, r] for k, r in zip(kv.keys[first:], kv.res_keys[first:], strict=True)],
            [[*v, r] for v, r in zip(kv.values[first:], kv.res_values[first:], strict=True)])


def _put(kv, first: int, kind: int, keys: list, values: list) -> None:
    """The stack's written arrays back into the pool's lists (kind 2: only residual rows)."""
    if kind == 0:
        kv.keys[first:], kv.values[first:] = [k[0] for k in keys], [v[0] for v in values]
    elif kind == 1:
        kv.keys[first:], kv.values[first:] = [tuple(k) for k in keys], [tuple(v) for v in values]
    else:
        kv.res_keys[first:] = [k[3] for k in keys]
        kv.res_values[first:] = [v[3] for v in values]


def _kind(kv, slots, decode_rows: int) -> tuple[int, str, dict] | None:
    """(kind, the attention path it needs, the C++ `StackKV` fields) of ``kv``'s layout; None
    for a layout the stack does not build (windowed layers, a residual step that fills a
    block and so quantizes it, writers other than the extension's). A residual pool's step
    is planned here, as layer 0's write would: its `block_view` then carries this step's
    map (the caller adds it, as ``res_map``)."""
    from engine.kvcache import rotation
    from engine.kvcache.residual import ResidualKVCache
    from engine.model.cpu_ext.ops import kv_write, kv_write_quant

    L = kv.layout
    if any(kv.windowed) or kv.row_writer is not kv_write:
        return None
    if L.k_quant is None and L.v_quant is None:
        return 0, "cpu", {}
    if L.k_quant is None or L.v_quant is None:
        return None
    fields = dict(k_bits=L.k_quant.bits, v_bits=L.v_quant.bits, v_group=L.v_quant.group_size,
                  rotate_k=bool(L.k_quant.rotation), rotate_v=bool(L.v_quant.rotation))
    if fields["rotate_k"] or fields["rotate_v"]:
        fields["rotation"] = rotation.signs(L.head_dim)
    if isinstance(kv, ResidualKVCache):
        if decode_rows != 1 or not L.key_channel or kv._plan(slots)[1]:
            return None  # its prefill kernel is another path; a filled block is quantized
        return 2, "cpu_residual", fields
    if L.residual or L.key_channel or kv.quant_writer is not kv_write_quant:
        return None
    return 1, "cpu", fields | {"k_group": L.k_quant.group_size}


def stacked(runner, h: mx.array, batch, kv) -> mx.array | None:
    """Every layer of ``runner``'s step (a `model_runner.StepBatch`, or a `PackedBatch` of
    decode rows: a verify step's) on the embeddings ``h`` through its `LayerStack`; None
    where the stack does not apply (the runner then builds them one by one). A packed
    step's rows go through each layer as (tokens, 1, hidden), as the runner's `_ext_block`
    gives them to its head and tail; each row's result is the same. The attention guard is
    asked with an unevaluated stand-in for layer 0's queries: it reads their shape and
    dtype only (layer 0 built in Python first cost ~0.18 ms of a verify step's serial path)."""
    from engine.model.attention import validated_kernel
    from engine.model.attention.cpu import lens_array
    from engine.model.cpu_ext.norm_rope import offsets_array

    if not runner.layers or not runner.use_kernels or not enabled():
        return None
    packed = hasattr(batch, "decode_tables")  # a `PackedBatch` of decode rows, one a token
    rows = h.reshape(h.shape[1], 1, -1) if packed else h  # the packed rows as the runner's
    first = runner.ext[0]  # its queries' shape and dtype, as `layer_head` makes them
    q0 = mx.zeros((rows.shape[0], first.heads, rows.shape[1], kv.layout.head_dim),
                  mx.result_type(rows, first.input_norm[0], first.qkv[0][0][1]))
    kind = _kind(kv, batch.slots, q0.shape[2])
    if kind is None:
        return None
    kind, path, fields = kind
    k_pool, v_pool = kv.block_view(0)
    if kind == 2:
        fields["res_map"] = k_pool.res_map
    tables, lens = ((batch.decode_tables, batch.decode_lens) if packed
                    else (batch.block_tables, batch.context_lens))
    if validated_kernel(q0, k_pool, v_pool, tables, lens, runner.attention[0]) != path:
        return None  # the route, the guard or a failure says otherwise: the usual build
    block_size = kv.layout.block_size
    stack = runner.stacks.get(block_size)
    if stack is None or stack.source is not runner.ext:
        stack = runner.stacks[block_size] = LayerStack(runner.ext, runner.attention, block_size)
    slots = kv._plan(batch.slots)[0] if kind == 2 else batch.slots  # residual slots
    keys, values = _sides(kv, 0, kind)
    out, keys, values = stack.run(rows, keys, values, 0, slots, tables, lens_array(lens),
                                  offsets_array(runner._offset(batch, rows.shape[1])),
                                  kind=kind, **fields)
    _put(kv, 0, kind, keys, values)
    return out.reshape(h.shape)
