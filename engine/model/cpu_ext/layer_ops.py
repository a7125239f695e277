"""A llama-family layer as two extension ops around attention.

A decode step of the default model was ~19 graph nodes per layer (two norms, four
matmuls, RoPE, two residual adds, splits, reshapes) at 3-8 us of dispatch each, against
~250 us of arithmetic: a third of the step. `layer_head` (input norm, fused q/k/v
projection, RoPE) and `layer_tail` (o_proj, residual, post-attention norm, gate/up,
SwiGLU, down, residual) compute the same ops in one node each, every step rounded to the
dtype its own op gives, so the runner's outputs stay bit-identical. Attention and the
K/V writes stay their own nodes: the attention route (and its guard) picks the kernel,
and a pool write must be a node of its own to update the pool in place.

`plan` says whether a layer can run this way and holds what the ops take.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from engine.model.cpu_ext import build
from engine.model.cpu_ext.linear import linear_args as _linear
from engine.model.cpu_ext.norm_rope import EXT_ROPES, CpuRMSNorm, offsets_array

Linear = tuple[list[mx.array], tuple[int, int, bool]]  # (w, scales, biases), (group, bits, tiled)


def _norm(module) -> tuple[mx.array, float] | None:
    return (module["weight"], module.eps) if type(module) is CpuRMSNorm else None


@dataclass(frozen=True)
class ExtLayer:
    """What one layer's `head` and `tail` ops take (the modules' own arrays, not copies)."""

    input_norm: tuple[mx.array, float]
    qkv: list[Linear]  # one fused projection, or q, k and v apart (`linear.QkvParts`)
    heads: int
    kv_heads: int
    rope: nn.Module  # one of `EXT_ROPES`
    o: Linear
    post_norm: tuple[mx.array, float]
    gate_up: Linear
    down: Linear

    def head(self, h: mx.array, offsets: int | mx.array):
        """(q (B, heads, L, D), k, v (kv_heads, B * L, D)) of h (B, L, hidden): what
        rms_norm, the fused projection and `qkv_rope.qkv_rope` give."""
        (w, eps), r = self.input_norm, self.rope
        q, k, v = build.require().layer_head(
            h, w, [a for wsb, _ in self.qkv for a in wsb], offsets_array(offsets), eps=eps,
            specs=[spec for _, spec in self.qkv], heads=self.heads,
            kv_heads=self.kv_heads, dims=r.dims, traditional=r.traditional, base=r.base,
            scale=r.scale, freqs=getattr(r, "freqs", None))
        return q, k, v

    def tail(self, h: mx.array, att: mx.array) -> mx.array:
        """The layer's output from its input h and attention's output att (B, heads, L, D)
        (its rows in h's row order): h1 = h + o_proj(att); h1 + down(swiglu(gate_up(
        post_norm(h1))))."""
        (w, eps) = self.post_norm
        return build.require().layer_tail(
            h, att, self.o[0], w, self.gate_up[0], self.down[0], eps=eps, o_spec=self.o[1],
            gate_up_spec=self.gate_up[1], down_spec=self.down[1])


def plan(layer, fused, heads: int, kv_heads: int) -> ExtLayer | None:
    """An `ExtLayer` for a fused llama-family layer whose linears are the extension's
    quantized ones (no biases), whose norms and RoPE are the extension's and whose MLP is
    SwiGLU over a fused gate/up; None for any other layer (it keeps the separate ops)."""
    if fused is None or fused.qkv_proj is None or fused.gate_up_proj is None:
        return None
    attn, mlp = layer.self_attn, layer.mlp
    if type(getattr(attn, "rope", None)) not in EXT_ROPES or hasattr(attn, "q_norm"):
        return None  # other RoPE variants, or Qwen3's per-head norm before RoPE
    qkv = [_linear(m) for m in getattr(fused.qkv_proj, "parts", [fused.qkv_proj])]
    parts = dict(input_norm=_norm(layer.input_layernorm), qkv=None if None in qkv else qkv,
                 o=_linear(attn.o_proj), post_norm=_norm(layer.post_attention_layernorm),
                 gate_up=_linear(fused.gate_up_proj), down=_linear(mlp.down_proj))
    if any(v is None for v in parts.values()):
        return None
    return ExtLayer(heads=heads, kv_heads=kv_heads, rope=attn.rope, **parts)
