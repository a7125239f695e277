"""RMSNorm and RoPE layers that run as one extension op each (the CPU fast path).

On the CPU backend MLX builds `mx.fast.rms_norm` and `mx.fast.rope` from their
fallbacks: about 11 and 34 dispatched ops. With two norms and two rotary embeddings
per layer that was over half of a decode step's graph (~2,000 of ~3,750 ops for the
default model) at ~5 us of dispatch each. `install(model)` swaps plain `nn.RMSNorm`
and `nn.RoPE` modules, and mlx-lm's `Llama3RoPE` (its scaled frequencies go in as
mx.fast.rope's ``freqs``), for subclasses that call the extension; other RoPE variants
(YaRN, long-RoPE) keep MLX's own. Gemma 3's norms (scale ``1 + weight``) and MLP
(`gelu_approx(gate) * up`, whose `tanh` and `power` are scalar libm calls in MLX's CPU
ops) become extension ops too, and so do its float16 residual sums (`clip_residual`).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten
from mlx_lm.models import gemma3_text
from mlx_lm.models.rope_utils import Llama3RoPE

from engine.model.cpu_ext import build, gemma_tail
from engine.model.cpu_ext.linear import rebind


def _ext():
    module = build.load()
    if module is None:
        raise RuntimeError(f"the CPU extension is unavailable: {build.unavailable_reason()}")
    return module


def rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    """`mx.fast.rms_norm` as one op: float32 math, result in the promoted dtype."""
    return _ext().rms_norm(x, weight, eps=eps)


def clip_residual(x: mx.array, y: mx.array) -> mx.array:
    """mlx-lm's Gemma 3 ``clip_residual``: float16 sums in float32 clipped to float16's
    range, as one op (MLX's casts, add and clip were ~8 nodes, 16 a layer); bit for bit the
    same. Other dtypes: ``x + y``, as there."""
    return _ext().clip_add(x, y) if x.dtype == mx.float16 else x + y


def offsets_array(offset: int | mx.array) -> mx.array:
    """A RoPE offset (an int, or one per batch row) as the extension's int32 (n,) array."""
    if not isinstance(offset, mx.array):
        return mx.array([int(offset)], dtype=mx.int32)
    if offset.dtype != mx.int32 or offset.ndim == 0:
        return offset.astype(mx.int32).reshape(-1)
    return offset


def rope(x: mx.array, *, dims: int, traditional: bool, base: float, scale: float,
         offset: int | mx.array, freqs: mx.array | None = None) -> mx.array:
    """`mx.fast.rope` of (B, H, L, D) as one op; ``offset`` an int or one per batch row;
    ``freqs`` (dims / 2,) replace the base's, as `mx.fast.rope` takes them."""
    return _ext().rope(x, offsets_array(offset), dims=dims, traditional=traditional,
                       base=base, scale=scale, freqs=freqs)


def swiglu(gate: mx.array, up: mx.array) -> mx.array:
    """mlx-lm's ``swiglu(gate, up)`` (silu(gate) * up) as one op, float32 math.

    MLX's CPU sigmoid is scalar (~30 ns an element here), and mlx-lm's swiglu runs as
    three ops once mx.compile is off: 23 ms per 512-token chunk of the default model's
    MLP against 1 ms for this.
    """
    return _ext().swiglu(gate, up)


def gelu_tanh_mul(gate: mx.array, up: mx.array) -> mx.array:
    """``nn.gelu_approx(gate) * up`` as one op, float32 math (within float32 rounding of
    MLX's: tanh is computed as a sigmoid from a vectorized exp)."""
    return _ext().gelu_tanh_mul(gate, up)


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


class CpuLlama3RoPE(Llama3RoPE):
    """mlx-lm's `Llama3RoPE` (Llama 3.x's scaled frequencies) computed by the extension."""

    base, scale = 1.0, 1.0  # what mx.fast.rope gets beside the frequencies (unused)

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        if x.ndim != 4:
            return super().__call__(x, offset)
        return rope(x, dims=self.dims, traditional=self.traditional, base=self.base,
                    scale=self.scale, offset=offset, freqs=self.freqs)

    @property
    def freqs(self) -> mx.array:
        """The scaled frequencies mlx-lm computed, float32 as the op takes them (already so:
        no cast node per call)."""
        f = self._freqs
        return f if f.dtype == mx.float32 else f.astype(mx.float32)


class _Held:
    """An array a module keeps out of its parameters (a derived, cached value)."""

    __slots__ = ("source", "value")

    def __init__(self, source: mx.array, value: mx.array):
        self.source, self.value = source, value


class CpuGemma3RMSNorm(gemma3_text.RMSNorm):
    """mlx-lm's Gemma 3 RMSNorm (scale ``1 + weight``) by the extension: one op instead of
    MLX's ~12 on the CPU; six per layer (q/k norms, pre/post attention and MLP). The scale
    is computed once per weight array, not an add node per call (156 a decode step)."""

    def gemma_scale(self) -> mx.array:
        """``1 + weight``, computed once per weight array."""
        w = self["weight"]
        held = self.__dict__.get("_scale")
        if held is None or held.source is not w:  # new weights (a load, an update)
            held = self.__dict__["_scale"] = _Held(w, 1.0 + w)
        return held.value

    def __call__(self, x: mx.array) -> mx.array:
        return rms_norm(x, self.gemma_scale(), self.eps)


class CpuGemma3MLP(gemma3_text.MLP):
    """mlx-lm's Gemma 3 MLP with its activation and product as one extension op.

    On a Gemma-3-1B-shaped Q4_0 model, libm's powf, tanhf and expm1f under MLX's ops were
    ~15 % of a 469-token prefill's samples."""

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(gelu_tanh_mul(self.gate_proj(x), self.up_proj(x)))


class CpuGemma3Block(gemma3_text.TransformerBlock):
    """mlx-lm's Gemma 3 decoder layer (its ``__call__`` line for line) with the residual
    sums as one op each (`clip_residual`); with quantized linears and a float16 residual
    stream, everything after attention is one op (`gemma_tail`), the same bits."""

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        parts = (gemma_tail.tail_parts(self) if x.dtype == mx.float16
                 and isinstance(self.self_attn, CpuGemma3Attention) else None)
        if parts is not None:
            att = self.self_attn.heads(self.input_layernorm(x), mask, cache)
            return gemma_tail.gemma_tail(x, att, parts)
        r = self.self_attn(self.input_layernorm(x), mask, cache)
        h = clip_residual(x, self.post_attention_layernorm(r))
        r = self.mlp(self.pre_feedforward_layernorm(h))
        return clip_residual(h, self.post_feedforward_layernorm(r))


class CpuGemma3Attention(gemma3_text.Attention):
    """mlx-lm's Gemma 3 attention (its ``__call__`` line for line) whose one-token rows
    (decode, packed steps) go (B, 1, H * D) <-> (B, H, 1, D) by reshapes alone: the same
    values without a transpose node each for q, k, v and the output (104 a decode step)."""

    def heads(self, x: mx.array, mask=None, cache=None) -> mx.array:
        """Attention's output (B, n_heads, L, D), before o_proj."""
        B, L, _ = x.shape
        queries, keys, values = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if L == 1:
            queries = queries.reshape(B, self.n_heads, 1, -1)
            keys = keys.reshape(B, self.n_kv_heads, 1, -1)
            values = values.reshape(B, self.n_kv_heads, 1, -1)
        else:
            queries = queries.reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
            keys = keys.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
            values = values.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        queries, keys = self.q_norm(queries), self.k_norm(keys)
        if cache is not None:
            queries = self.rope(queries, offset=cache.offset)
            keys = self.rope(keys, offset=cache.offset)
            keys, values = cache.update_and_fetch(keys, values)
        else:
            queries, keys = self.rope(queries), self.rope(keys)
        return gemma3_text.scaled_dot_product_attention(
            queries, keys, values, cache=cache, scale=self.scale, mask=mask)

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        B, L, _ = x.shape
        output = self.heads(x, mask, cache)
        if L == 1:
            return self.o_proj(output.reshape(B, 1, -1))
        return self.o_proj(output.transpose(0, 2, 1, 3).reshape(B, L, -1))


GEMMA3_OPS = (CpuGemma3RMSNorm, CpuGemma3MLP, CpuGemma3Block, CpuGemma3Attention)


def has_gemma3_ops(model: nn.Module) -> bool:
    """Whether `install` gave ``model`` Gemma 3 norms, MLPs, attention or layers (their
    rounding is not MLX's, so the loader keys cached K/V apart)."""
    return any(isinstance(m, GEMMA3_OPS) for _, m in model.named_modules())


EXT_ROPES = (CpuRoPE, CpuLlama3RoPE)
"""RoPE modules the extension computes (the two-op layers take them too)."""


# Module types and their extension subclasses, in rounds: a rebound module keeps the
# children it had, so a parent is swapped in a round after its parts.
SWAP_ROUNDS = (
    {nn.RMSNorm: CpuRMSNorm, nn.RoPE: CpuRoPE, Llama3RoPE: CpuLlama3RoPE,
     gemma3_text.RMSNorm: CpuGemma3RMSNorm, gemma3_text.MLP: CpuGemma3MLP},
    {gemma3_text.Attention: CpuGemma3Attention},
    {gemma3_text.TransformerBlock: CpuGemma3Block},
)


def install(model: nn.Module) -> int:
    """Swap plain `nn.RMSNorm`, `nn.RoPE`, Llama 3 RoPE and Gemma 3 norm, MLP, attention
    and layer modules of `model` in place; returns how many."""
    count = 0
    for table in SWAP_ROUNDS:
        swaps = [(name, rebind(table[type(module)], module))
                 for name, module in model.named_modules()
                 if type(module) in table and (type(module) is not nn.RoPE
                                               or module.base is not None)]
        if swaps:
            model.update_modules(tree_unflatten(swaps))
        count += len(swaps)
    return count
