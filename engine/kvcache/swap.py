"""Preemption by swapping: a sequence's K/V leave the pool for host memory and come back.

On a Mac the "host" copy is ordinary unified memory outside the KV budget; on
CPU it is plain RAM. Either way the pool's blocks are free while the sequence
waits, and restoring copies the exact bytes back, so the output is unchanged.
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


class HostSwap:
    """Moves whole sequences between the KV pool and host arrays, within a byte budget."""

    def __init__(self, kv: PagedKVCache, blocks: BlockManager, budget_bytes: int):
        self.kv = kv
        self.blocks = blocks
        self.budget_bytes = budget_bytes
        self.used_bytes = 0

    def _bytes(self, num_tokens: int) -> int:
        return num_tokens * self.kv.layout.bytes_per_token

    def can_swap_out(self, num_tokens: int) -> bool:
        return num_tokens > 0 and self.used_bytes + self._bytes(num_tokens) <= self.budget_bytes

    def swap_out(self, seq_id: int, num_tokens: int) -> SwappedKV:
        """Copy the sequence's first ``num_tokens`` K/V rows to host and free its blocks."""
        slots = mx.array(self.blocks.slots(seq_id, 0, num_tokens), dtype=mx.int32)
        keys, values = self.kv.take(slots)
        mx.eval(keys, values)
        self.used_bytes += self._bytes(num_tokens)
        self.blocks.free(seq_id)
        return SwappedKV(keys, values, num_tokens)

    def swap_in(self, seq_id: int, saved: SwappedKV) -> None:
        """Allocate blocks again and write the saved K/V back (the exact bytes)."""
        n = saved.num_tokens
        self.blocks.allocate(seq_id, n)
        slots = mx.array(self.blocks.slots(seq_id, 0, n), dtype=mx.int32)
        self.kv.put(slots, saved.keys, saved.values)
        mx.eval(self.kv.keys, self.kv.values)
        self.drop(saved)

    def drop(self, saved: SwappedKV | None) -> None:
        """Forget a host copy (after swap-in, or when its sequence ends while swapped)."""
        if saved is not None and saved.num_tokens:
            self.used_bytes -= self._bytes(saved.num_tokens)
            saved.num_tokens = 0  # dropping twice must not count twice
