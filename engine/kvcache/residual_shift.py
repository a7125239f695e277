"""Moving the keys of a residual pool's blocks: a context shift on the -kivi formats.

A context shift re-rotates the keys of the blocks that close up behind the sinks
(`model.rope_shift`). What a residual pool (`kvcache.residual`) stores apart moves here: a
block still filling keeps its exact rows in the side store, which move in place (no
rounding but the dtype's); full blocks with keys per channel over the block's tokens are
dequantized, their Hadamard rotation undone, moved, and quantized again as whole blocks
(one more rounding, as on the other quantized pools). Full blocks with keys per token are
stored as any quantized pool's and are left to `KeyShifter`'s own path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import mlx.core as mx

from engine.kvcache import channel_quant, rotation
from engine.kvcache.residual import ResidualKVCache

# (layer, (kv_heads, n, head_dim) float32 keys) -> the keys moved
Move = Callable[[int, mx.array], mx.array]


def move_keys(kv: ResidualKVCache, block_ids: Sequence[int], move: Move) -> list[int]:
    """Apply ``move`` to the keys of every row of ``block_ids`` in every layer that are in
    the side store or per channel; returns the full blocks whose keys are per token (the
    caller moves those as any quantized pool's)."""
    L = kv.layout
    H, bs, D, q = L.num_kv_heads, L.block_size, L.head_dim, L.k_quant
    rows_of = {b: int(kv._res_of[b]) for b in block_ids}  # the side-store row, -1 when full
    full = [b for b, r in rows_of.items() if r < 0]
    filling = [r for r in rows_of.values() if r >= 0]
    channel = full if L.key_channel else []
    res_at = mx.array([r * bs + i for r in filling for i in range(bs)], dtype=mx.int32)
    ids = mx.array(channel, dtype=mx.int32)
    for layer in range(L.num_layers):
        if filling:
            store = kv.res_keys[layer]
            store[:, res_at] = move(layer, store[:, res_at].astype(mx.float32)).astype(L.dtype)
        if channel:  # (H, n, D, ·) per block: stored rotated over the head dim
            store = kv.keys[layer]
            rows = channel_quant.dequantize_channels(*(a[:, ids] for a in store), q.bits)
            rows = rows.reshape(H, -1, D).astype(mx.float32)
            moved = move(layer, rotation.unrotate(rows) if q.rotation else rows)
            if q.rotation:
                moved = rotation.rotate(moved)
            new = channel_quant.quantize_channels(moved.reshape(H, len(channel), bs, D), q.bits)
            for part, value in zip(store, new, strict=True):
                part[:, ids] = value
    mx.eval(kv.keys, kv.res_keys)
    return [] if L.key_channel else full
