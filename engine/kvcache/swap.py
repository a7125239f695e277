"""Preemption by swapping: a sequence's K/V leave the pool for host memory and come back.

On a Mac the "host" copy is ordinary unified memory outside the KV budget; on
CPU it is plain RAM. Either way the pool's blocks are free while the sequence
waits, and restoring copies the exact bytes back, so the output is unchanged.
"""

from __future__ import annotations

import mlx.core as mx

from engine.kvcache.block_manager import BlockManager
from engine.kvcache.kv_cache import PagedKVCache
from engine.request import Request


class HostSwap:
    """Moves whole sequences between the KV pool and host arrays, within a byte budget."""

    def __init__(self, kv: PagedKVCache, blocks: BlockManager, budget_bytes: int):
        self.kv = kv
        self.blocks = blocks
        self.budget_bytes = budget_bytes
        self.used_bytes = 0

    def _bytes(self, num_tokens: int) -> int:
        return num_tokens * self.kv.layout.bytes_per_token

    def can_swap_out(self, req: Request) -> bool:
        return (req.num_computed > 0
                and self.used_bytes + self._bytes(req.num_computed) <= self.budget_bytes)

    def swap_out(self, req: Request) -> None:
        """Copy the sequence's computed K/V to host arrays and free its blocks."""
        n = req.num_computed
        slots = mx.array(self.blocks.slots(req.request_id, 0, n), dtype=mx.int32)
        keys = [k[:, slots] for k in self.kv.keys]
        values = [v[:, slots] for v in self.kv.values]
        mx.eval(keys, values)
        req.swap = (keys, values, n)
        self.used_bytes += self._bytes(n)
        self.blocks.free(req.request_id)

    def swap_in(self, req: Request) -> None:
        """Allocate blocks again and write the saved K/V back (the exact bytes)."""
        keys, values, n = req.swap
        self.blocks.allocate(req.request_id, n)
        slots = mx.array(self.blocks.slots(req.request_id, 0, n), dtype=mx.int32)
        for layer, (k, v) in enumerate(zip(keys, values, strict=True)):
            self.kv.keys[layer][:, slots] = k
            self.kv.values[layer][:, slots] = v
        mx.eval(self.kv.keys, self.kv.values)
        req.num_computed = n
        self.drop(req)

    def drop(self, req: Request) -> None:
        """Forget a request's host copy (after swap-in, or when it ends while swapped)."""
        if req.swap is not None:
            self.used_bytes -= self._bytes(req.swap[2])
            req.swap = None
