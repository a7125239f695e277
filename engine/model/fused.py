"""Fused projections for llama-family layers: q/k/v as one matmul, gate/up as another.

On CPU each dispatched op costs ~10 us and small GEMVs underuse the BLAS, so the runner's
fused path (`architectures.FUSED`) computes them together; row i of a product is the
same dot product either way, so outputs are bit-identical to the unfused modules.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn


@dataclass(slots=True)
class FusedLayer:
    """One layer's projections concatenated: 2 matmuls instead of 5.

    On CPU each dispatched op costs ~10 us and small GEMVs underuse the BLAS,
    so q/k/v and gate/up are computed as one matmul each. Row i of a product
    is the same dot product either way (same K order), so outputs are
    bit-identical to the unfused modules (checked by the parity tests).
    """

    w_qkv: mx.array | None  # (q + k + v out, hidden); None: q, k, v apart (qkv_proj)
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
    from engine.model.cpu_ext.linear import QkvParts, fuse

    attn, mlp = layer.self_attn, layer.mlp
    projs = [attn.q_proj, attn.k_proj, attn.v_proj]
    qkv = fuse(projs)
    if qkv is None:  # q, k and v of other bits (a K-quant file's v): side by side
        qkv = QkvParts.of(projs)
    if qkv is None:
        return None
    nq, nk = attn.q_proj.weight.shape[0], attn.k_proj.weight.shape[0]
    ffn = [getattr(mlp, "gate_proj", None), getattr(mlp, "up_proj", None)]
    gate_up = fuse(ffn) if all(m is not None for m in ffn) else None
    n_ff = ffn[0].weight.shape[0] if gate_up is not None else 0
    return FusedLayer(getattr(qkv, "weight", None), None, (nq, nq + nk),
                      gate_up.weight if gate_up is not None else None, n_ff,
                      qkv_proj=qkv, gate_up_proj=gate_up)


def fuse_layers(layers) -> list[FusedLayer | None]:
    """`fuse_layer` of every layer, one at a time so the unfused copies go before the next."""
    fused = []
    for layer in layers:
        f = fuse_layer(layer)
        # Materialize the modules' split views too: a lazy view belongs to this thread's
        # stream, and an engine built later on another thread would fail to evaluate it.
        mx.eval([f.w_qkv, f.w_gate_up] if f else [], layer.parameters())
        fused.append(f)
    return fused
