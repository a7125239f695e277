"""Block bookkeeping for the paged KV pool: free list, refcounts, block tables.

Pure Python, no MLX: the pool's arrays live in `kv_cache.PagedKVCache`; this
class decides which physical block holds which tokens of which sequence.

Invariants (checked by `check_invariants`, property-tested in tests):
- every block is exactly one of: free (ref 0, on the free list); cached (ref 0,
  hashed, evictable in LRU order); in use (ref >= 1, maybe hashed);
- ref_counts[b] == number of block-table entries, over live sequences, naming b;
- a sequence holds exactly ceil(num_tokens / block_size) blocks;
- a block shared by several sequences is never written: appending into a
  shared, partially filled last block copies it first (copy-on-write).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine.errors import OutOfBlocksError
from engine.kvcache.window_blocks import WindowBlocks


@dataclass(slots=True)
class SlotPlan:
    """Where the next tokens of a sequence go, and the block copies needed first."""

    slots: list[int]  # flat slot index (block_id * block_size + offset) per new token
    copies: list[tuple[int, int]]  # (src_block, dst_block) copy-on-write pairs


class BlockManager:
    """Allocates fixed-size blocks to sequences and tracks their reference counts."""

    def __init__(self, num_blocks: int, block_size: int, window: WindowBlocks | None = None):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.block_tables: dict[int, list[int]] = {}
        self.num_tokens: dict[int, int] = {}
        # prefix cache: full blocks registered under their chained hash
        self.block_hash: dict[int, bytes] = {}
        self.block_tokens: dict[int, tuple[int, ...]] = {}
        self.hash_to_block: dict[bytes, int] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached, ref 0, LRU first
        self.evictions = 0
        self.window = window  # sliding-window layers' storage (window_blocks.py), if any
        # told of a block that `truncate` left partly filled (a residual pool may have
        # quantized it when a rejected draft filled it)
        self.on_reopen: Callable[[int], object] | None = None

    # -- queries -----------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: free ones plus cached ones it may evict."""
        return len(self.free_block_ids) + len(self.evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Unreferenced blocks kept for their prefix (evictable)."""
        return len(self.evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_shared_blocks(self) -> int:
        return sum(1 for r in self.ref_counts if r > 1)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _new_blocks_for(self, seq_id: int, num_new_tokens: int) -> int:
        """Blocks an append must take from the free list, counting a copy-on-write."""
        n = self.num_tokens[seq_id]
        table = self.block_tables[seq_id]
        extra = self.blocks_needed(n + num_new_tokens) - len(table)
        cow = n % self.block_size != 0 and self.ref_counts[table[-1]] > 1
        return extra + (1 if cow and num_new_tokens > 0 else 0)

    # -- check / act pairs ------------------------------------------------------
    def _window_blocks_for(self, have: int, num_tokens: int, cow: int) -> int:
        """Window blocks an append to ``num_tokens`` over ``have`` blocks gives out: its
        fresh blocks that the window still covers (see `WindowBlocks.track`)."""
        first = self.window.first_needed(num_tokens)
        return max(0, self.blocks_needed(num_tokens) - max(have, first)) + cow

    def can_allocate(self, num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) <= self.num_free_blocks and (
            self.window is None
            or self.window.can_take(self._window_blocks_for(0, num_tokens, 0)))

    def allocate(self, seq_id: int, num_tokens: int = 0) -> SlotPlan:
        """Register a new sequence and reserve slots for its first ``num_tokens``."""
        if seq_id in self.block_tables:
            raise ValueError(f"sequence {seq_id} already has blocks")
        self.block_tables[seq_id] = []
        self.num_tokens[seq_id] = 0
        try:
            return self.append(seq_id, num_tokens)
        except OutOfBlocksError:
            del self.block_tables[seq_id], self.num_tokens[seq_id]
            raise

    def can_append(self, seq_id: int, num_new_tokens: int) -> bool:
        new = self._new_blocks_for(seq_id, num_new_tokens)
        if new > self.num_free_blocks:
            return False
        if self.window is None:
            return True
        have, n = len(self.block_tables[seq_id]), self.num_tokens[seq_id]
        cow = int(new > self.blocks_needed(n + num_new_tokens) - have)
        return self.window.can_take(self._window_blocks_for(have, n + num_new_tokens, cow))

    def append(self, seq_id: int, num_new_tokens: int) -> SlotPlan:
        """Reserve slots for ``num_new_tokens`` more tokens of ``seq_id``.

        Returns the slots to write and the copy-on-write block copies that must
        be done *before* writing (the caller copies the K/V rows).
        """
        if not self.can_append(seq_id, num_new_tokens):
            raise OutOfBlocksError(
                f"need {self._new_blocks_for(seq_id, num_new_tokens)} blocks, "
                f"{self.num_free_blocks} free"
            )
        table = self.block_tables[seq_id]
        n = self.num_tokens[seq_id]
        copies: list[tuple[int, int]] = []
        if num_new_tokens > 0 and n % self.block_size and self.ref_counts[table[-1]] > 1:
            src = table[-1]
            dst = self._take_block()
            self.ref_counts[src] -= 1
            table[-1] = dst
            copies.append((src, dst))
            if self.window is not None:
                self.window.replace(seq_id, src, dst)
        fresh = len(table)
        while len(table) < self.blocks_needed(n + num_new_tokens):
            table.append(self._take_block())
        self.num_tokens[seq_id] = n + num_new_tokens
        if self.window is not None:
            self.window.track(seq_id, table, n + num_new_tokens, fresh)
        return SlotPlan(self.slots(seq_id, n, n + num_new_tokens), copies)

    def truncate(self, seq_id: int, num_tokens: int) -> int:
        """Give back the last ``num_tokens`` slots of ``seq_id`` (drafts that were rejected);
        returns the blocks freed. Only slots reserved by the latest `append` may go back."""
        if self.window is not None:
            raise ValueError("a sliding-window pool cannot give slots back")
        n = self.num_tokens[seq_id] - num_tokens
        if num_tokens < 0 or n < 0:
            raise ValueError(f"cannot give back {num_tokens} slots of sequence {seq_id}")
        table, freed = self.block_tables[seq_id], 0
        while len(table) > self.blocks_needed(n):
            b = table.pop()
            assert self.ref_counts[b] == 1 and b not in self.block_hash, b
            self.ref_counts[b] = 0
            self.free_block_ids.appendleft(b)  # the next append takes it again
            freed += 1
        self.num_tokens[seq_id] = n
        if n % self.block_size and self.on_reopen is not None:
            self.on_reopen(table[-1])
        return freed

    def slots(self, seq_id: int, start: int, stop: int) -> list[int]:
        """Flat pool slots (block_id * block_size + offset) of tokens start..stop-1."""
        bs, table = self.block_size, self.block_tables[seq_id]
        return [table[t // bs] * bs + t % bs for t in range(start, stop)]

    def fork(self, parent_id: int, child_id: int) -> None:
        """Give ``child_id`` the same blocks as ``parent_id`` by reference."""
        if child_id in self.block_tables:
            raise ValueError(f"sequence {child_id} already has blocks")
        table = list(self.block_tables[parent_id])
        for b in table:
            self.ref_counts[b] += 1
        self.block_tables[child_id] = table
        self.num_tokens[child_id] = self.num_tokens[parent_id]
        if self.window is not None:
            self.window.track(child_id, table, self.num_tokens[child_id], len(table))

    def free(self, seq_id: int) -> int:
        """Drop ``seq_id``'s block references exactly once; returns blocks freed.

        Freeing an unknown (or already freed) sequence is a no-op, so every
        release path may call it without double-counting.
        """
        table = self.block_tables.pop(seq_id, None)
        if table is None:
            return 0
        del self.num_tokens[seq_id]
        if self.window is not None:
            self.window.release(seq_id, table, self.block_hash)
        freed = 0
        # In table order, so a later sequence tends to get an ascending run of
        # ids again (the reference attention reads such a run without a gather).
        for b in table:
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                if b in self.block_hash:
                    self.evictable[b] = None  # most recently used last
                else:
                    self.free_block_ids.append(b)
                freed += 1
        return freed

    def _take_block(self) -> int:
        if self.free_block_ids:
            b = self.free_block_ids.popleft()
        else:  # evict the least recently used cached block
            b, _ = self.evictable.popitem(last=False)
            self._unhash(b)
            self.evictions += 1
        assert self.ref_counts[b] == 0
        self.ref_counts[b] = 1
        return b

    # -- prefix cache -----------------------------------------------------------------
    def lookup(self, hashes: Sequence[bytes], token_blocks: Sequence[Sequence[int]]) -> list[int]:
        """Block ids caching the longest prefix of ``hashes``; tokens are compared on every hit."""
        found = []
        for h, tokens in zip(hashes, token_blocks, strict=False):
            b = self.hash_to_block.get(h)
            if b is None or self.block_tokens[b] != tuple(tokens):
                break
            found.append(b)
        if self.window is not None:  # the windowed layers must find their rows too
            return found[: self.window.usable_prefix(found)]
        return found

    def allocate_cached(self, seq_id: int, cached: Sequence[int]) -> None:
        """Start ``seq_id`` on cached full blocks, by reference (their K/V is reused)."""
        if seq_id in self.block_tables:
            raise ValueError(f"sequence {seq_id} already has blocks")
        for b in cached:
            if self.ref_counts[b] == 0:
                del self.evictable[b]
            self.ref_counts[b] += 1
        self.block_tables[seq_id] = list(cached)
        self.num_tokens[seq_id] = len(cached) * self.block_size
        if self.window is not None:
            table = self.block_tables[seq_id]
            self.window.track(seq_id, table, self.num_tokens[seq_id], len(table))

    def register(self, block_id: int, block_hash: bytes, tokens: Sequence[int]) -> bool:
        """Name a full, computed block by its chained hash so later prompts can reuse it."""
        if block_hash in self.hash_to_block or block_id in self.block_hash:
            return False  # an identical block is cached already (or this one is)
        assert self.ref_counts[block_id] > 0 and len(tokens) == self.block_size
        self.block_hash[block_id] = block_hash
        self.block_tokens[block_id] = tuple(tokens)
        self.hash_to_block[block_hash] = block_id
        return True

    def drop_cached(self) -> int:
        """Forget every unreferenced cached block (they become free); returns how many."""
        n = len(self.evictable)
        while self.evictable:
            b, _ = self.evictable.popitem(last=False)
            self._unhash(b)
            self.free_block_ids.append(b)
        return n

    def _unhash(self, b: int) -> None:
        h = self.block_hash.pop(b)
        del self.block_tokens[b], self.hash_to_block[h]
        if self.window is not None:
            self.window.forget_block(b)

    # -- invariants --------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent."""
        counts = [0] * self.num_blocks
        for seq_id, table in self.block_tables.items():
            assert len(table) == self.blocks_needed(self.num_tokens[seq_id]), seq_id
            for b in table:
                counts[b] += 1
        assert counts == self.ref_counts, "refcounts differ from block tables"
        free = set(self.free_block_ids)
        assert len(free) == len(self.free_block_ids), "duplicate free block"
        assert not free & set(self.evictable), "a block both free and cached"
        for b in range(self.num_blocks):
            idle = b in free or b in self.evictable
            assert idle == (self.ref_counts[b] == 0), f"block {b} state"
            assert (b in self.evictable) <= (b in self.block_hash), f"cached block {b} unhashed"
            assert (b in free) <= (b not in self.block_hash), f"free block {b} hashed"
        assert {self.hash_to_block[h] for h in self.block_hash.values()} == set(self.block_hash)
        if self.window is not None:
            self.window.check_invariants(self.block_tables)
