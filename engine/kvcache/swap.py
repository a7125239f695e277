"""Preemption by swapping: a sequence's K/V leave the pool for host memory and come back.

On a Mac the "host" copy is ordinary unified memory outside the KV budget; on
CPU it is plain RAM. Either way the pool's blocks are free while the sequence
waits, and restoring copies the exact bytes back, so the output is unchanged.

A residual pool (`kvcache.residual`) holds a sequence's newest, filling block outside its
quantized store: its full blocks go as stored bytes and that block's exact rows apart.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from engine.kvcache.block_manager import BlockManager
from engine.kvcache.kv_cache import PagedKVCache, Store


@dataclass(slots=True)
class SwappedKV:
    """A swapped-out sequence's K/V: per layer, its first ``num_tokens`` rows as stored."""

    keys: list[Store]
    values: list[Store]
    num_tokens: int
    rows: tuple | None = None  # a residual pool's filling block: (K rows, V rows) per layer


class HostSwap:
    """Moves whole sequences between the KV pool and host arrays, within a byte budget."""

    def __init__(self, kv: PagedKVCache, blocks: BlockManager, budget_bytes: int):
        self.kv = kv
        self.blocks = blocks
        self.budget_bytes = budget_bytes
        self.used_bytes = 0

    def _bytes(self, num_tokens: int) -> int:
        L = self.kv.layout
        tail = num_tokens % L.block_size if L.residual else 0  # exact rows: compute dtype
        exact = 2 * L.num_layers * L.num_kv_heads * L.head_dim * L.dtype.size
        return (num_tokens - tail) * L.bytes_per_token + tail * exact

    def can_swap_out(self, num_tokens: int) -> bool:
        return num_tokens > 0 and self.used_bytes + self._bytes(num_tokens) <= self.budget_bytes

    def _whole(self, num_tokens: int) -> int:
        """Tokens that go as stored bytes: all, or a residual pool's full blocks only."""
        L = self.kv.layout
        return num_tokens - num_tokens % L.block_size if L.residual else num_tokens

    def swap_out(self, seq_id: int, num_tokens: int) -> SwappedKV:
        """Copy the sequence's first ``num_tokens`` K/V rows to host and free its blocks."""
        slots, whole = self.blocks.slots(seq_id, 0, num_tokens), self._whole(num_tokens)
        keys, values = self.kv.take(mx.array(slots[:whole], dtype=mx.int32)) if whole else ([], [])
        rows = None
        if whole < num_tokens:
            rows = self.kv.take_rows(slots[whole] // self.kv.layout.block_size,
                                     num_tokens - whole)
        mx.eval(keys, values, rows or ())
        self.used_bytes += self._bytes(num_tokens)
        self.blocks.free(seq_id)
        return SwappedKV(keys, values, num_tokens, rows)

    def swap_in(self, seq_id: int, saved: SwappedKV) -> None:
        """Allocate blocks again and write the saved K/V back (the exact bytes)."""
        n = saved.num_tokens
        self.blocks.allocate(seq_id, n)
        slots, whole = self.blocks.slots(seq_id, 0, n), self._whole(n)
        if whole:
            self.kv.put(mx.array(slots[:whole], dtype=mx.int32), saved.keys, saved.values)
        if saved.rows is not None:
            self.kv.put_rows(slots[whole] // self.kv.layout.block_size, *saved.rows)
        mx.eval(*self.kv.arrays)
        self.drop(saved)

    def drop(self, saved: SwappedKV | None) -> None:
        """Forget a host copy (after swap-in, or when its sequence ends while swapped)."""
        if saved is not None and saved.num_tokens:
            self.used_bytes -= self._bytes(saved.num_tokens)
            saved.num_tokens = 0  # dropping twice must not count twice
