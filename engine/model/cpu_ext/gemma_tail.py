"""Gemma 3's layer after attention as one extension op (`gemma_tail`).

After the one-op norms, residual sums and MLP activation, a Gemma decode step was still
~28 graph nodes a layer (739 a step for a 26-layer model, against 7 a layer for the
llama-family two-op layers) at several us of dispatch each. The tail computes o_proj,
the post-attention norm, the float16 residual sum, the pre-MLP norm, gate, up, the tanh
GELU product, down, the post-MLP norm and the second residual sum in one node, each step
rounded to the dtype its own op gives: bit for bit the separate ops. A prefill chunk runs
64 rows at a time when every linear is tiled, so its MLP activations are 64 rows', not
512's (the memory bar of a long prompt).
"""

from __future__ import annotations

import mlx.core as mx

from engine.model.cpu_ext import build
from engine.model.cpu_ext.linear import linear_args

ENABLED = True  # off: the separate ops (for A/B runs and the bit-for-bit tests)


def tail_parts(block) -> tuple | None:
    """((o, gate, up, down), norm scales, eps) of a Gemma 3 layer whose linears are the
    extension's quantized ones and whose norms are the extension's Gemma norms; None for
    any other layer (it keeps the separate ops)."""
    if not ENABLED:
        return None
    attn, mlp = block.self_attn, block.mlp
    linears = [linear_args(m) for m in (attn.o_proj, mlp.gate_proj, mlp.up_proj,
                                        mlp.down_proj)]
    norms = (block.post_attention_layernorm, block.pre_feedforward_layernorm,
             block.post_feedforward_layernorm)
    if None in linears or not all(hasattr(n, "gemma_scale") for n in norms):
        return None
    if len({n.eps for n in norms}) != 1:
        return None
    return linears, [n.gemma_scale() for n in norms], norms[0].eps


def gemma_tail(h: mx.array, att: mx.array, parts: tuple) -> mx.array:
    """The layer's output from its float16 input h (B, L, hidden) and attention's output
    att (B, heads, L, D) (its rows in h's row order), `tail_parts` giving the weights."""
    (o, gate, up, down), norms, eps = parts
    return build.require().gemma_tail(
        h, att, o[0], norms, gate[0], up[0], down[0], eps=eps,
        specs=[o[1], gate[1], up[1], down[1]])
