"""Runs an mlx-lm model's layers with attention over the paged KV pool.

Why not plug into mlx-lm's cache protocol: `update_and_fetch` returns one dense
K/V per batch with a single scalar offset, so ragged batches (each sequence at
its own position, with its own block table) do not fit. We reuse mlx-lm's
modules instead (projections, norms, RoPE, MLP, embeddings, weight loading and
sanitizing for every llama-family model and Qwen3) and own only the forward:
project, RoPE at per-sequence offsets, write K/V into block slots, paged
attention. That keeps each mlx-lm model file the single source of truth.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.activations import swiglu

from engine.kvcache.kv_cache import KVLayout, PagedKVCache
from engine.kvcache.quant import QuantSpec
from engine.model.attention import AttentionSpec, paged_attention
from engine.model.cpu_ext.norm_rope import swiglu as cpu_swiglu
from engine.model.packed_batch import PackedBatch

Interrupt = Callable[[], bool]


class StepInterrupted(Exception):
    """A forward stopped between layer groups because its step is no longer wanted."""

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(slots=True)
class StepBatch:
    """Inputs of one forward pass: B sequences with L new tokens each."""

    input_ids: mx.array  # (B, L) int32
    offsets: mx.array  # (B,) int32: position of each sequence's first new token
    slots: mx.array  # (B * L,) int32: pool slot of every new token, row-major
    block_tables: mx.array  # (B, max_blocks) int32
    context_lens: list[int]  # tokens per sequence including the new ones
    block_run: int | None = None  # B == 1 and the blocks are a contiguous run from here


@dataclass(slots=True)
class FusedLayer:
    """One layer's projections concatenated: 2 matmuls instead of 5.

    On CPU each dispatched op costs ~10 us and small GEMVs underuse the BLAS,
    so q/k/v and gate/up are computed as one matmul each. Row i of a product
    is the same dot product either way (same K order), so outputs are
    bit-identical to the unfused modules (checked by the parity tests).
    """

    w_qkv: mx.array  # (q + k + v out, hidden)
    b_qkv: mx.array | None
    qkv_split: tuple[int, int]  # split points of the qkv output
    w_gate_up: mx.array | None  # (2 * intermediate, hidden); None if the MLP is not SwiGLU
    gate_up_split: int
    qkv_proj: nn.Module | None = None  # quantized (CPU extension): computes q/k/v at once
    gate_up_proj: nn.Module | None = None  # quantized: gate/up at once


def _plain(*mods) -> bool:
    return all(type(m) is nn.Linear for m in mods)


def fuse_layer(layer) -> FusedLayer | None:
    """Fused projections for a layer with float (unquantized) nn.Linear weights."""
    attn, mlp = layer.self_attn, layer.mlp
    projs = (attn.q_proj, attn.k_proj, attn.v_proj)
    if not _plain(*projs):
        return fuse_layer_quantized(layer)
    biases = ["bias" in p for p in projs]
    if any(biases) and not all(biases):
        return None
    w_qkv = mx.concatenate([p.weight for p in projs])
    b_qkv = mx.concatenate([p.bias for p in projs]) if all(biases) else None
    nq, nk = attn.q_proj.weight.shape[0], attn.k_proj.weight.shape[0]
    # The modules keep views into the fused arrays, so the weights are not duplicated.
    attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight = mx.split(w_qkv, [nq, nq + nk])
    if b_qkv is not None:
        attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias = mx.split(b_qkv, [nq, nq + nk])
    w_gate_up, n_ff = None, 0
    ffn = getattr(mlp, "gate_proj", None), getattr(mlp, "up_proj", None)
    if all(ffn) and _plain(*ffn) and "bias" not in ffn[0] and "bias" not in ffn[1]:
        w_gate_up = mx.concatenate([ffn[0].weight, ffn[1].weight])
        n_ff = ffn[0].weight.shape[0]
        mlp.gate_proj.weight, mlp.up_proj.weight = mx.split(w_gate_up, [n_ff])
    return FusedLayer(w_qkv, b_qkv, (nq, nq + nk), w_gate_up, n_ff)


def fuse_layer_quantized(layer) -> FusedLayer | None:
    """Fused projections for quantized linears on the CPU extension (`cpu_ext.linear.fuse`):
    packed rows, scales and biases concatenated, one `qmm` for q/k/v and one for gate/up;
    None for any other quantized layer (MLX's own path keeps the modules as they are)."""
    from engine.model.cpu_ext.linear import fuse

    attn, mlp = layer.self_attn, layer.mlp
    qkv = fuse([attn.q_proj, attn.k_proj, attn.v_proj])
    if qkv is None:
        return None
    nq, nk = attn.q_proj.weight.shape[0], attn.k_proj.weight.shape[0]
    ffn = [getattr(mlp, "gate_proj", None), getattr(mlp, "up_proj", None)]
    gate_up = fuse(ffn) if all(m is not None for m in ffn) else None
    n_ff = ffn[0].weight.shape[0] if gate_up is not None else 0
    return FusedLayer(qkv.weight, None, (nq, nq + nk),
                      gate_up.weight if gate_up is not None else None, n_ff,
                      qkv_proj=qkv, gate_up_proj=gate_up)


class PagedModel:
    """Forward pass of a llama-family mlx-lm model over a `PagedKVCache`."""

    def __init__(self, model: nn.Module, model_type: str):
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model type {model_type!r} is not supported by the paged engine "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        self.model = model
        inner = model.model
        self.embed_tokens = inner.embed_tokens
        self.layers = inner.layers
        self.norm = inner.norm
        self.tied = getattr(model.args, "tie_word_embeddings", False) or not hasattr(
            model, "lm_head"
        )
        attn = self.layers[0].self_attn
        self.num_heads = attn.n_heads
        self.num_kv_heads = attn.n_kv_heads
        args = model.args
        self.head_dim = getattr(args, "head_dim", None) or (
            args.hidden_size // args.num_attention_heads
        )
        # A quantized embedding computes in the dtype of its scales.
        self.dtype = getattr(self.embed_tokens, "scales", self.embed_tokens.weight).dtype
        self.fused: list[FusedLayer | None] = [None] * len(self.layers)
        # What each layer's attention computes beyond q/k/v (windows and sinks come here).
        self.attention = [AttentionSpec(layer.self_attn.scale) for layer in self.layers]
        self.use_kernels = True  # decode kernels where they apply (EngineConfig.kernels)

    def fuse_projections(self) -> bool:
        """Concatenate projection weights (float models); returns whether all layers fused."""
        self.fused = [fuse_layer(layer) for layer in self.layers]
        mx.eval([f.w_qkv for f in self.fused if f], [f.w_gate_up for f in self.fused if f])
        # Materialize the modules' split views too: a lazy view belongs to this thread's
        # stream, and an engine built later on another thread would fail to evaluate it.
        mx.eval(self.model.parameters())
        return all(self.fused)

    def kv_layout(self, block_size: int, dtype: mx.Dtype | None = None, *,
                  k_quant: QuantSpec | None = None, v_quant: QuantSpec | None = None,
                  ) -> KVLayout:
        return KVLayout(
            num_layers=len(self.layers),
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            block_size=block_size,
            dtype=dtype or self.dtype,
            k_quant=k_quant,
            v_quant=v_quant,
        )

    def _qkv(self, attn, x: mx.array, fused: FusedLayer | None):
        if fused is None:
            return attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
        if fused.qkv_proj is not None:
            qkv = fused.qkv_proj(x)
        elif fused.b_qkv is not None:
            qkv = mx.addmm(fused.b_qkv, x, fused.w_qkv.T)
        else:
            qkv = x @ fused.w_qkv.T
        return mx.split(qkv, fused.qkv_split, axis=-1)

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

    def _attention(self, attn, x: mx.array, layer: int, batch: StepBatch, kv: PagedKVCache):
        B, L, _ = x.shape
        q, k, v = self._qkv(attn, x, self.fused[layer])
        q = q.reshape(B, L, self.num_heads, -1)
        k = k.reshape(B, L, self.num_kv_heads, -1)
        if hasattr(attn, "q_norm"):  # Qwen3: per-head RMSNorm before RoPE
            q, k = attn.q_norm(q), attn.k_norm(k)
        offset = batch.offsets if B > 1 else int(batch.context_lens[0]) - L
        q = attn.rope(q.transpose(0, 2, 1, 3), offset=offset)
        k = attn.rope(k.transpose(0, 2, 1, 3), offset=offset)
        # pool rows are (kv_heads, slot, head_dim); slots run row-major over (B, L)
        kv.write(
            layer,
            batch.slots,
            k.transpose(1, 0, 2, 3).reshape(self.num_kv_heads, B * L, -1),
            v.reshape(B * L, self.num_kv_heads, -1).transpose(1, 0, 2),
        )
        k_pool, v_pool = kv.block_view(layer)
        o = paged_attention(q, k_pool, v_pool, batch.block_tables, batch.context_lens,
                            self.attention[layer], block_run=batch.block_run,
                            use_kernels=self.use_kernels)
        return attn.o_proj(o.transpose(0, 2, 1, 3).reshape(B, L, -1))

    def _layers(self, h: mx.array, attention, kv: PagedKVCache, interrupt: Interrupt | None,
                group: int) -> mx.array:
        """Every layer on ``h``; with ``interrupt``, evaluated ``group`` layers at a time and
        stopped (`StepInterrupted`) when it says so.

        The graph of a layer group is built only after the previous group ran, so an
        interrupted forward leaves no lazy K/V writes behind to be computed later.
        """
        for i, layer in enumerate(self.layers):
            h = h + attention(layer.self_attn, layer.input_layernorm(h), i)
            h = h + self._mlp(layer.mlp, layer.post_attention_layernorm(h), self.fused[i])
            if interrupt is not None and (i + 1) % group == 0 and i + 1 < len(self.layers):
                mx.eval(h, kv.keys[: i + 1], kv.values[: i + 1])
                if interrupt():
                    raise StepInterrupted
        return h

    def _logits(self, h: mx.array) -> mx.array:
        h = self.norm(h)
        return self.embed_tokens.as_linear(h) if self.tied else self.model.lm_head(h)

    def __call__(self, batch: StepBatch, kv: PagedKVCache, *, logits: bool = True,
                 interrupt: Interrupt | None = None, group: int = 1):
        """Run the model; returns (B, vocab) logits of each sequence's last token.

        With ``logits=False`` only K/V are written (prefill chunks whose
        outputs are not sampled) and None is returned. ``interrupt`` and ``group``:
        see `_layers`.
        """
        h = self.embed_tokens(batch.input_ids)
        h = self._layers(h, lambda a, x, i: self._attention(a, x, i, batch, kv), kv,
                         interrupt, group)
        if not logits:
            return None
        return self._logits(h[:, -1:, :])[:, -1, :]

    def _packed_attention(self, attn, x: mx.array, layer: int, batch: PackedBatch,
                          kv: PagedKVCache):
        T = x.shape[1]
        q, k, v = self._qkv(attn, x, self.fused[layer])
        # every token is its own row for RoPE, at its own position (bit-identical to
        # rotating a sequence's run at a scalar offset)
        q = q.reshape(T, 1, self.num_heads, -1)
        k = k.reshape(T, 1, self.num_kv_heads, -1)
        if hasattr(attn, "q_norm"):
            q, k = attn.q_norm(q), attn.k_norm(k)
        q = attn.rope(q.transpose(0, 2, 1, 3), offset=batch.positions)  # (T, Hq, 1, D)
        k = attn.rope(k.transpose(0, 2, 1, 3), offset=batch.positions)
        kv.write(layer, batch.slots, k.reshape(T, self.num_kv_heads, -1).transpose(1, 0, 2),
                 v.reshape(T, self.num_kv_heads, -1).transpose(1, 0, 2))
        k_pool, v_pool = kv.block_view(layer)
        outs = []
        for seg in batch.prefills:
            qs = q[seg.start:seg.start + seg.length].transpose(2, 1, 0, 3)  # (1, Hq, n, D)
            o = paged_attention(qs, k_pool, v_pool, seg.block_table, [seg.context_len],
                                self.attention[layer], block_run=seg.block_run,
                                use_kernels=self.use_kernels)
            outs.append(o.transpose(0, 2, 1, 3).reshape(seg.length, -1))
        if batch.decode_lens:
            o = paged_attention(q[batch.decode_start:], k_pool, v_pool, batch.decode_tables,
                                batch.decode_lens, self.attention[layer],
                                use_kernels=self.use_kernels)
            outs.append(o.reshape(len(batch.decode_lens), -1))
        o = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)
        return attn.o_proj(o[None])

    def forward_packed(self, batch: PackedBatch, kv: PagedKVCache, *,
                       interrupt: Interrupt | None = None, group: int = 1):
        """Run a packed step; returns (decodes, vocab) logits of the decode tokens, or None
        when the step has none."""
        h = self.embed_tokens(batch.input_ids)
        h = self._layers(h, lambda a, x, i: self._packed_attention(a, x, i, batch, kv), kv,
                         interrupt, group)
        if not batch.decode_lens:
            return None
        return self._logits(h[:, batch.decode_start:, :])[0]
