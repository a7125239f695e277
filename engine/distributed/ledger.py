"""Each rank's view of the block pool, kept in step with rank 0's block manager.

Only rank 0 allocates and frees blocks: the other ranks write the slots they are told.
"Freeing" a block on another rank is therefore rank 0's bookkeeping reaching it. Rank 0
sends, with every message, the blocks whose reference count or cached state changed since
its last message (`LedgerSender`); each rank applies them (`BlockLedger`), so a cancel,
finish or timeout on rank 0 reaches every rank with the next step. Each rank checks every
write against its ledger: a slot in a block that is not in use would be a bookkeeping
bug across ranks, and is counted (`writes_outside`, reported, expected 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.kvcache.block_manager import BlockManager

REPORT_FIELDS = ("rank", "layer_start", "layer_stop", "kv_heads", "num_blocks", "block_size",
                 "bytes_per_token", "blocks_used", "blocks_cached", "blocks_free",
                 "blocks_touched", "writes_outside", "steps", "tokens_written")


@dataclass(slots=True)
class RankReport:
    """One rank's pool accounting (`REPORT_FIELDS`, all ints)."""

    rank: int
    layer_start: int
    layer_stop: int
    kv_heads: int
    num_blocks: int
    block_size: int
    bytes_per_token: int
    blocks_used: int
    blocks_cached: int
    blocks_free: int
    blocks_touched: int  # distinct blocks this rank ever wrote K/V into
    writes_outside: int  # slots written in blocks not in use: must be 0
    steps: int
    tokens_written: int

    @property
    def pool_bytes(self) -> int:
        return self.num_blocks * self.block_size * self.bytes_per_token

    def to_array(self) -> np.ndarray:
        return np.asarray([getattr(self, f) for f in REPORT_FIELDS], np.int32)

    @classmethod
    def from_array(cls, a: np.ndarray) -> RankReport:
        return cls(*(int(v) for v in a))

    def to_dict(self) -> dict:
        return {f: getattr(self, f) for f in REPORT_FIELDS} | {"pool_bytes": self.pool_bytes}


class BlockLedger:
    """Reference counts and cached flags of every block, as rank 0 last sent them."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.refs = np.zeros(num_blocks, np.int32)
        self.cached = np.zeros(num_blocks, bool)
        self.touched = np.zeros(num_blocks, bool)
        self.writes_outside = 0
        self.steps = 0
        self.tokens_written = 0

    def apply(self, delta: np.ndarray) -> None:
        """Apply (block, ref count, cached) triples from `LedgerSender.delta`."""
        if len(delta):
            t = delta.reshape(-1, 3)
            self.refs[t[:, 0]] = t[:, 1]
            self.cached[t[:, 0]] = t[:, 2].astype(bool)

    def wrote(self, slots: np.ndarray) -> None:
        """Record a step's writes; count any into a block that is not in use."""
        blocks = np.asarray(slots, np.int64) // self.block_size
        self.touched[blocks] = True
        self.writes_outside += int(np.count_nonzero(self.refs[blocks] <= 0))
        self.steps += 1
        self.tokens_written += len(blocks)

    def free_ids(self) -> list[int]:
        """Blocks neither in use nor cached (a residual pool takes back their rows)."""
        return np.flatnonzero((self.refs <= 0) & ~self.cached).tolist()

    def counts(self) -> tuple[int, int, int]:
        """(used, cached, free) blocks."""
        used = int(np.count_nonzero(self.refs > 0))
        cached = int(np.count_nonzero((self.refs == 0) & self.cached))
        return used, cached, self.num_blocks - used - cached


class LedgerSender:
    """Rank 0: the changes of its block manager since the last message, as int32 triples."""

    def __init__(self, blocks: BlockManager):
        self.blocks = blocks
        self._refs = np.zeros(blocks.num_blocks, np.int32)
        self._cached = np.zeros(blocks.num_blocks, bool)

    def snapshot(self) -> tuple[np.ndarray, np.ndarray]:
        refs = np.asarray(self.blocks.ref_counts, np.int32)
        cached = np.zeros(self.blocks.num_blocks, bool)
        evictable = list(self.blocks.evictable)
        if evictable:
            cached[evictable] = True
        return refs, cached

    def delta(self) -> np.ndarray:
        refs, cached = self.snapshot()
        changed = np.flatnonzero((refs != self._refs) | (cached != self._cached))
        self._refs, self._cached = refs, cached
        if not len(changed):
            return np.zeros(0, np.int32)
        return np.stack([changed, refs[changed], cached[changed]], axis=1).astype(
            np.int32).reshape(-1)
