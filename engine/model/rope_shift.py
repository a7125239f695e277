"""Move pooled keys back by a number of positions: the RoPE delta of a context shift.

RoPE rotates each pair of a key's channels by ``position * theta_i``; rotations of one
plane compose, so applying the model's own RoPE at offset ``-delta`` to a key stored at
position ``p`` gives the key at ``p - delta`` (exact up to float rounding). The op runs on
the pool itself, with MLX, so every backend (the reference path, the CPU extension's
layers, the Metal and CUDA kernels) reads the same shifted keys.

Only plain RoPE is shifted (``nn.RoPE`` and mlx-lm's ``Llama3RoPE``, and the CPU extension's
subclasses of them: a rotation by fixed frequencies); scaled variants that also multiply
the key (Su/Yarn's mscale) or rotate part-way by position-dependent rules, windowed layers
and layers without RoPE are refused with one line (`refusal`). A quantized K side is
dequantized, its Hadamard rotation (`kvcache.rotation`) undone, shifted, and quantized
again (one more rounding); a residual pool's full blocks likewise, per block, and its
filling blocks' exact rows in place (`kvcache.residual_shift`).
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.rope_utils import Llama3RoPE

from engine.kvcache import rotation
from engine.kvcache.kv_cache import PagedKVCache, _quantize
from engine.kvcache.residual import ResidualKVCache
from engine.kvcache.residual_shift import move_keys

SHIFTABLE_ROPES = (nn.RoPE, Llama3RoPE)


def refusal(runner) -> str | None:
    """Why this model's keys cannot be shifted in place, in one line; None if they can."""
    name = getattr(runner.text, "model_type", None) or "this model"
    if runner.modules:
        return (f"context shift needs kvchat's own attention path with plain RoPE; "
                f"{name} runs on mlx-lm's modules (its positions are not all plain RoPE)")
    if any(runner.windows):
        return f"context shift cannot move {name}'s sliding-window layers"
    for layer in runner.layers:
        rope = getattr(layer.self_attn, "rope", None)
        if not isinstance(rope, SHIFTABLE_ROPES):  # the CPU extension's are subclasses
            return (f"context shift needs plain RoPE on every layer; {name} uses "
                    f"{type(rope).__name__ if rope is not None else 'no RoPE'}")
    return None


class KeyShifter:
    """Re-rotates pooled keys of whole blocks by ``-delta`` positions, layer by layer."""

    def __init__(self, runner, kv: PagedKVCache):
        self.ropes = [layer.self_attn.rope for layer in runner.layers]
        self.kv = kv

    def shift(self, block_ids: Sequence[int], delta: int) -> None:
        """Keys of every row of ``block_ids`` (all layers) move back by ``delta`` positions."""
        if not block_ids or delta == 0:
            return
        if isinstance(self.kv, ResidualKVCache):  # its side store and per-channel keys
            block_ids = move_keys(self.kv, block_ids, lambda layer, rows: self._rotate(
                self.ropes[layer], rows, delta))
            if not block_ids:
                return
        L = self.kv.layout
        bs = L.block_size
        slots = mx.array([b * bs + r for b in block_ids for r in range(bs)], dtype=mx.int32)
        for layer, rope in enumerate(self.ropes):
            at = self.kv.slots_for(layer, slots)
            store = self.kv.keys[layer]
            if L.k_quant is None:
                store[:, at] = self._rotate(rope, store[:, at], delta).astype(store.dtype)
                continue
            q = L.k_quant
            rows = mx.dequantize(*(a[:, at] for a in store), group_size=q.group_size,
                                 bits=q.bits)
            if q.rotation:
                rows = rotation.unrotate(rows)
            for part, new in zip(store, _quantize(self._rotate(rope, rows, delta), q),
                                 strict=True):
                part[:, at] = new
        mx.eval(self.kv.keys)

    @staticmethod
    def _rotate(rope, rows: mx.array, delta: int) -> mx.array:
        """(kv_heads, n, head_dim) keys at their positions -> at ``delta`` positions fewer."""
        H, n, D = rows.shape
        one = rows.astype(mx.float32).reshape(H * n, 1, D)  # every row alone: offset applies
        return rope(one, offset=-delta).reshape(H, n, D)
