"""Runs an mlx-lm model's layers with attention over the paged KV pool.

Why not mlx-lm's caches: `update_and_fetch` returns one dense K/V per batch, so ragged
batches (each sequence at its own position, with its own block table) do not fit. We
reuse mlx-lm's modules (projections, norms, RoPE, MLPs, experts, embeddings, weight
loading and sanitizing) and own only attention over the pool: K/V written into block
slots, paged attention. Each mlx-lm model file stays the single source of truth.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.activations import swiglu

from engine.kvcache.kv_cache import KVLayout, PagedKVCache
from engine.kvcache.quant import QuantSpec
from engine.model import architectures
from engine.model.attention import AttentionSpec, paged_attention
from engine.model.cpu_ext import layer_ops, layer_stack
from engine.model.cpu_ext.layer_ops import ExtLayer
from engine.model.cpu_ext.norm_rope import swiglu as cpu_swiglu
from engine.model.fused import FusedLayer, fuse_layers
from engine.model.layer_step import LayerStep, route_attention
from engine.model.memory import no_buffer_cache, release_freed
from engine.model.packed_batch import PackedBatch

Interrupt = Callable[[], bool]


class StepInterrupted(Exception):
    """A forward stopped between layer groups because its step is no longer wanted."""

SUPPORTED_MODEL_TYPES = tuple(architectures.supported_types())


@dataclass(slots=True)
class StepBatch:
    """Inputs of one forward pass: B sequences with L new tokens each."""

    input_ids: mx.array  # (B, L) int32
    offsets: mx.array  # (B,) int32: position of each sequence's first new token
    slots: mx.array  # (B * L,) int32: pool slot of every new token, row-major
    block_tables: mx.array  # (B, max_blocks) int32
    context_lens: list[int]  # tokens per sequence including the new ones
    block_run: int | None = None  # B == 1 and the blocks are a contiguous run from here


class PagedModel:
    """Forward pass of an mlx-lm model (`architectures.ARCHITECTURES`) over a `PagedKVCache`."""

    def __init__(self, model: nn.Module, model_type: str):
        self.model = model
        self.text = architectures.text_model(model)  # a multimodal wrapper's language model
        inner_type = getattr(self.text, "model_type", None) or model_type
        if inner_type not in architectures.ARCHITECTURES:
            raise ValueError(f"model type {model_type!r} is not supported by the paged engine "
                             f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
        self.arch = architectures.ARCHITECTURES[inner_type]
        self.args = args = self.text.args
        inner = self.text.model
        self.embed_tokens = inner.embed_tokens
        self.layers = inner.layers
        self.norm = inner.norm
        self.tied = (getattr(args, "tie_word_embeddings", False)
                     or not hasattr(self.text, "lm_head"))
        self.num_heads, self.num_kv_heads, self.head_dim = architectures.head_layout(
            self.layers[0].self_attn, args)
        # A quantized embedding computes in the dtype of its scales.
        self.dtype = getattr(self.embed_tokens, "scales", self.embed_tokens.weight).dtype
        self.fused: list[FusedLayer | None] = [None] * len(self.layers)
        self.ext: list[ExtLayer | None] = [None] * len(self.layers)  # the two-op layers
        self.windows = architectures.layer_windows(self.text)
        if len(self.windows) != len(self.layers):  # a pipeline rank's slice of the layers
            if any(self.windows):
                raise ValueError("a slice of a model with sliding-window layers cannot run")
            self.windows = [None] * len(self.layers)
        self.modules = self.arch.path == "modules"
        # What each layer's attention computes beyond q/k/v; on the modules path the scale
        # and sinks come from the module's own call (`_spec`).
        self.attention = [AttentionSpec(getattr(layer.self_attn, "scale", 1.0), w)
                          for layer, w in zip(self.layers, self.windows, strict=True)]
        if self.modules:
            route_attention(self.text)
        self.use_kernels = True  # decode kernels where they apply (EngineConfig.kernels)
        self.stacks: dict[int, layer_stack.LayerStack] = {}  # by block size

    @property
    def stack_layers(self) -> bool:
        """Every layer an `ExtLayer` that `layer_stack` can build."""
        return layer_stack.LayerStack.applies(self.ext, self.attention)

    def describe(self) -> str:
        """What this model uses, in a few words (the model line of the CLI and the TUI)."""
        return architectures.describe(self)

    def fuse_projections(self) -> bool:
        """Concatenate projection weights (float llama-family models); returns whether all
        layers fused. The modules path keeps mlx-lm's modules as they are."""
        if self.modules:
            return False
        with no_buffer_cache():  # each layer's unfused arrays freed as it is fused
            self.fused = fuse_layers(self.layers)
            self.ext = [layer_ops.plan(layer, f, self.num_heads, self.num_kv_heads)
                        for layer, f in zip(self.layers, self.fused, strict=True)]
            mx.eval(self.model.parameters())
        release_freed()
        return all(self.fused)

    def kv_layout(self, block_size: int, dtype: mx.Dtype | None = None, *,
                  k_quant: QuantSpec | None = None, v_quant: QuantSpec | None = None,
                  ) -> KVLayout:
        return KVLayout(num_layers=len(self.layers), num_kv_heads=self.num_kv_heads,
                        head_dim=self.head_dim, block_size=block_size,
                        dtype=dtype or self.dtype, k_quant=k_quant, v_quant=v_quant)

    @staticmethod
    def _qkv(x: mx.array, fused: FusedLayer) -> mx.array:
        """q | k | v of every token from the fused projection."""
        if fused.qkv_proj is not None:
            return fused.qkv_proj(x)
        if fused.b_qkv is not None:
            return mx.addmm(fused.b_qkv, x, fused.w_qkv.T)
        return x @ fused.w_qkv.T

    def _mlp(self, mlp, x: mx.array, fused: FusedLayer | None):
        if fused is None or fused.w_gate_up is None:
            return mlp(x)
        if fused.gate_up_proj is None:
            gate_up = x @ fused.w_gate_up.T
            gate, up = mx.split(gate_up, [fused.gate_up_split], axis=-1)
            return mlp.down_proj(swiglu(gate, up))
        # the extension's path: its one-op swiglu (MLX's CPU sigmoid is scalar and slow)
        gate, up = mx.split(fused.gate_up_proj(x), [fused.gate_up_split], axis=-1)
        return mlp.down_proj(cpu_swiglu(gate, up))

    @staticmethod
    def _offset(batch: StepBatch | PackedBatch, L: int):
        """RoPE offsets of a step's rows: a scalar for one sequence, else one per row."""
        if isinstance(batch, PackedBatch):
            return batch.positions  # every token is its own row, at its own position
        return batch.offsets if len(batch.context_lens) > 1 else int(batch.context_lens[0]) - L

    def _attend(self, q: mx.array, k: mx.array, v: mx.array, layer: int,
                batch: StepBatch | PackedBatch, kv: PagedKVCache, spec: AttentionSpec):
        """Write this step's K/V and attend over the pool; q/k/v and the result are
        (rows, heads, L, head_dim), packed steps one row per token (L == 1)."""
        rows, _, L, _ = k.shape
        # pool rows (kv_heads, slot, head_dim), slots row-major; one row: no transpose node
        k, v = (a if rows == 1 else a.transpose(1, 0, 2, 3) for a in (k, v))
        kv.write(layer, batch.slots,
                 *(a.reshape(self.num_kv_heads, rows * L, -1) for a in (k, v)))
        return self._paged(q, layer, batch, kv, spec)

    def _paged(self, q: mx.array, layer: int, batch: StepBatch | PackedBatch,
               kv: PagedKVCache, spec: AttentionSpec):
        """Attention of q (this step's K/V already in the pool) over each sequence's blocks."""
        k_pool, v_pool = kv.block_view(layer)
        # a windowed layer's store numbers blocks its own way, so no contiguous run
        windowed = kv.windowed[layer]
        if not isinstance(batch, PackedBatch):
            return paged_attention(q, k_pool, v_pool, kv.tables_for(layer, batch.block_tables),
                                   batch.context_lens, spec,
                                   block_run=None if windowed else batch.block_run,
                                   use_kernels=self.use_kernels)
        outs = []
        for seg in batch.prefills:
            qs = q[seg.start:seg.start + seg.length].transpose(2, 1, 0, 3)  # (1, Hq, n, D)
            o = paged_attention(qs, k_pool, v_pool, kv.tables_for(layer, seg.block_table),
                                [seg.context_len], spec,
                                block_run=None if windowed else seg.block_run,
                                use_kernels=self.use_kernels)
            outs.append(o.transpose(2, 1, 0, 3))
        if batch.decode_lens:
            outs.append(paged_attention(q[batch.decode_start:], k_pool, v_pool,
                                        kv.tables_for(layer, batch.decode_tables),
                                        batch.decode_lens, spec,
                                        use_kernels=self.use_kernels))
        return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)

    def _attention(self, attn, x: mx.array, layer: int, batch: StepBatch | PackedBatch,
                   kv: PagedKVCache):
        """The fused path's attention block: projections, RoPE, pool, o_proj."""
        B, L, _ = x.shape
        fused = self.fused[layer]
        if isinstance(batch, PackedBatch):
            B, L = L, 1  # one row per token, so RoPE takes each token's own position
        if fused is None:
            q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
        else:
            q, k, v = mx.split(self._qkv(x, fused), fused.qkv_split, axis=-1)
        q = q.reshape(B, L, self.num_heads, -1)
        k = k.reshape(B, L, self.num_kv_heads, -1)
        if hasattr(attn, "q_norm"):  # Qwen3: per-head RMSNorm before RoPE
            q, k = attn.q_norm(q), attn.k_norm(k)
        offset = self._offset(batch, L)
        q = attn.rope(q.transpose(0, 2, 1, 3), offset=offset)
        k = attn.rope(k.transpose(0, 2, 1, 3), offset=offset)
        v = v.reshape(B, L, self.num_kv_heads, -1).transpose(0, 2, 1, 3)
        o = self._attend(q, k, v, layer, batch, kv, self.attention[layer])
        return attn.o_proj(o.transpose(0, 2, 1, 3).reshape(x.shape[0], x.shape[1], -1))

    def _spec(self, layer: int, scale: float, sinks: mx.array | None) -> AttentionSpec:
        spec = self.attention[layer]
        if spec.scale != scale or spec.sinks is not sinks:
            spec = self.attention[layer] = AttentionSpec(scale, self.windows[layer], sinks)
        return spec

    def _block(self, i: int, layer, h: mx.array, batch: StepBatch | PackedBatch,
               kv: PagedKVCache) -> mx.array:
        if self.ext[i] is not None:  # the extension's two ops around attention
            return self._ext_block(i, h, batch, kv)
        if not self.modules:
            h = h + self._attention(layer.self_attn, layer.input_layernorm(h), i, batch, kv)
            return h + self._mlp(layer.mlp, layer.post_attention_layernorm(h), self.fused[i])

        def attend(q, k, v, scale, sinks):
            return self._attend(q, k, v, i, batch, kv, self._spec(i, scale, sinks))

        step = LayerStep(self._offset(batch, h.shape[1]), attend)
        if self.arch.call is not None:
            return self.arch.call(self.args, layer, h, step)
        return layer(h, None, step)

    def _ext_block(self, i: int, h: mx.array, batch: StepBatch | PackedBatch,
                   kv: PagedKVCache) -> mx.array:
        """An `ExtLayer`'s output."""
        rows = h.reshape(h.shape[1], 1, -1) if isinstance(batch, PackedBatch) else h
        q, k, v = self.ext[i].head(rows, self._offset(batch, rows.shape[1]))
        kv.write(i, batch.slots, k, v)
        return self.ext[i].tail(h, self._paged(q, i, batch, kv, self.attention[i]))

    def _layers(self, h: mx.array, batch: StepBatch | PackedBatch, kv: PagedKVCache,
                interrupt: Interrupt | None = None, group: int = 1) -> mx.array:
        """Every layer on ``h``; with ``interrupt``, evaluated ``group`` layers at a time and
        stopped (`StepInterrupted`) when it says so.

        The graph of a layer group is built only after the previous group ran, so an
        interrupted forward leaves no lazy K/V writes behind. The layers of a step run whole
        (no prefill segments packed) are one C++ call where `layer_stack.stacked` allows."""
        if ((interrupt is None or group >= len(self.layers)) and self.stack_layers
                and not getattr(batch, "prefills", None)):
            out = layer_stack.stacked(self, h, batch, kv)
            return out if out is not None else self._layers_from(0, h, batch, kv)
        return self._layers_from(0, h, batch, kv, interrupt, group)

    def _layers_from(self, start: int, h: mx.array, batch: StepBatch | PackedBatch,
                     kv: PagedKVCache, interrupt: Interrupt | None = None,
                     group: int = 1) -> mx.array:
        shape = h.shape
        if self.modules and isinstance(batch, PackedBatch):
            h = h.reshape(shape[1], 1, shape[2])  # mlx-lm's modules: one row per token
        for i, layer in enumerate(self.layers[start:], start):
            h = self._block(i, layer, h, batch, kv)
            if interrupt is not None and (i + 1) % group == 0 and i + 1 < len(self.layers):
                mx.eval(h, kv.keys[: i + 1], kv.values[: i + 1])
                if interrupt():
                    raise StepInterrupted
        return h.reshape(shape)

    def embed(self, input_ids: mx.array) -> mx.array:
        """Token embeddings as the architecture scales them."""
        h = self.embed_tokens(input_ids)
        return h if self.arch.embed_scale is None else self.arch.embed_scale(self.args, h)

    def hidden(self, batch: StepBatch | PackedBatch, kv: PagedKVCache, *,
               interrupt: Interrupt | None = None, group: int = 1) -> mx.array:
        """The last layer's hidden states of every new token (K/V written on the way)."""
        return self._layers(self.embed(batch.input_ids), batch, kv, interrupt, group)

    def _logits(self, h: mx.array) -> mx.array:
        h = self.norm(h)
        out = self.embed_tokens.as_linear(h) if self.tied else self.text.lm_head(h)
        return out if self.arch.logits_scale is None else self.arch.logits_scale(self.args, out)

    def __call__(self, batch: StepBatch, kv: PagedKVCache, *, logits: bool = True,
                 interrupt: Interrupt | None = None, group: int = 1):
        """Run the model; returns (B, vocab) logits of each sequence's last token.

        With ``logits=False`` only K/V are written (prefill chunks whose
        outputs are not sampled) and None is returned. ``interrupt`` and ``group``:
        see `_layers`.
        """
        h = self.hidden(batch, kv, interrupt=interrupt, group=group)
        if not logits:
            return None
        return self._logits(h[:, -1:, :])[:, -1, :]

    def forward_packed(self, batch: PackedBatch, kv: PagedKVCache, *,
                       interrupt: Interrupt | None = None, group: int = 1):
        """Run a packed step; returns (decodes, vocab) logits of the decode tokens, or None
        when the step has none."""
        h = self.hidden(batch, kv, interrupt=interrupt, group=group)
        if not batch.decode_lens:
            return None
        return self._logits(h[:, batch.decode_start:, :])[0]
