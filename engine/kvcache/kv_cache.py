"""The paged KV pool: per layer, one K and one V array of fixed-size blocks.

Layout per layer: ``(num_kv_heads, num_blocks * block_size, head_dim)``, viewed
as ``(num_kv_heads, num_blocks, block_size, head_dim)`` by attention: head-major,
so one sequence's gathered blocks are contiguous per head without a transpose. Writes go
through MLX indexing (``pool[slots] = rows``), which updates in place when the
pool has a single owner, so a step never copies the whole pool.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Shape and format of the KV pool; everything needed for byte accounting."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: mx.Dtype

    @property
    def bytes_per_token(self) -> int:
        """layers x 2 (K and V) x kv_heads x head_dim x bytes per element."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.dtype.size

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    def num_blocks_for(self, budget_bytes: int) -> int:
        """How many whole blocks fit in ``budget_bytes``."""
        return budget_bytes // self.bytes_per_block


class PagedKVCache:
    """K/V block storage for every layer of one model."""

    def __init__(self, layout: KVLayout, num_blocks: int):
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block")
        self.layout = layout
        self.num_blocks = num_blocks
        shape = (layout.num_kv_heads, num_blocks * layout.block_size, layout.head_dim)
        self.keys = [mx.zeros(shape, layout.dtype) for _ in range(layout.num_layers)]
        self.values = [mx.zeros(shape, layout.dtype) for _ in range(layout.num_layers)]
        mx.eval(self.keys, self.values)

    @property
    def nbytes(self) -> int:
        """Bytes the pool holds (all blocks, used or not)."""
        return self.num_blocks * self.layout.bytes_per_block

    def block_view(self, layer: int) -> tuple[mx.array, mx.array]:
        """Layer ``layer``'s pools as ``(kv_heads, num_blocks, block_size, head_dim)``."""
        L = self.layout
        shape = (L.num_kv_heads, self.num_blocks, L.block_size, L.head_dim)
        return self.keys[layer].reshape(shape), self.values[layer].reshape(shape)

    def write(self, layer: int, slots: mx.array, keys: mx.array, values: mx.array) -> None:
        """Store ``keys``/``values`` of shape (kv_heads, N, head_dim) at ``slots``."""
        self.keys[layer][:, slots] = keys.astype(self.layout.dtype)
        self.values[layer][:, slots] = values.astype(self.layout.dtype)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole blocks (src -> dst) in every layer: the copy-on-write step."""
        if not copies:
            return
        bs = self.layout.block_size
        src = mx.array([s * bs + i for s, _ in copies for i in range(bs)])
        dst = mx.array([d * bs + i for _, d in copies for i in range(bs)])
        for layer in range(self.layout.num_layers):
            self.keys[layer][:, dst] = self.keys[layer][:, src]
            self.values[layer][:, dst] = self.values[layer][:, src]
        mx.eval(self.keys, self.values)
