"""Storage for sliding-window layers: only the blocks some window still covers.

A layer with window W reads the last W positions only, so a sequence's blocks wholly
before its window hold nothing those layers will read again. Global layers keep every
block in the pool (`BlockManager`); windowed layers keep their rows in a smaller store
of *window blocks*, and ``wmap[block]`` names the window block holding a block's rows
for those layers (-1: none). Window block 0 is scratch: rows for a block without one
are written there and never read (the window mask hides those positions).

A block holds a window block while it is *needed*: some live sequence's next queries
may read it. Trimming keeps, per sequence, every block from ``length - W - margin`` on,
``length`` counting the tokens just appended: the margin covers that chunk's own
queries (>= one chunk) and the prefix cache's disk writer, which reads a chunk's rows
one step after computing them (>= two chunks - W; `wiring.window_pool` sizes it). When a
sequence ends, its still-needed blocks that the prefix cache names stay *retained*
(evictable, least recently used first), so the next turn of a chat hits them; a
prefix hit counts only up to the blocks whose window rows exist (`usable_prefix`).
"""

from __future__ import annotations

from collections import OrderedDict, deque

from engine.errors import OutOfBlocksError


def pool_bytes(bytes_per_block: int, num_layers: int, windowed_layers: int, blocks: int,
               window_blocks: int) -> int:
    """Bytes of ``blocks`` pool blocks (``bytes_per_block`` counting every layer) whose
    ``windowed_layers`` hold ``window_blocks`` window blocks instead."""
    per_layer = bytes_per_block // num_layers
    return per_layer * ((num_layers - windowed_layers) * blocks + windowed_layers * window_blocks)


class WindowBlocks:
    """Which window block holds each pool block's rows for the windowed layers."""

    def __init__(self, num_blocks: int, num_window_blocks: int, block_size: int,
                 window: int, margin: int, layers: int = 1):
        if num_window_blocks < 2:
            raise ValueError("windowed layers need at least one block besides scratch")
        self.block_size, self.window, self.margin = block_size, window, margin
        self.layers = layers  # how many windowed layers store their rows here
        self.peak_used = 0
        self.num_window_blocks = num_window_blocks
        self.wmap = [-1] * num_blocks
        self.free_ids: deque[int] = deque(range(1, num_window_blocks))
        self.need = [0] * num_blocks  # live sequences whose window may still read the block
        # per sequence: (first block still needed, end of the blocks counted in `need`)
        self.first: dict[int, tuple[int, int]] = {}
        self.retained: OrderedDict[int, None] = OrderedDict()  # need 0, kept for prefixes
        self.version = 0  # bumps on every wmap change (the pool re-uploads its map)

    # -- queries ------------------------------------------------------------------------
    @property
    def num_used(self) -> int:
        """Window blocks held for live sequences (not free, not merely retained)."""
        return self.num_window_blocks - 1 - len(self.free_ids) - len(self.retained)

    def held(self, seq_id: int) -> int:
        """Window blocks ``seq_id`` holds now."""
        first, upto = self.first.get(seq_id, (0, 0))
        return upto - first

    def can_take(self, n: int) -> bool:
        return n <= len(self.free_ids) + len(self.retained)

    def first_needed(self, num_tokens: int) -> int:
        """The first block a sequence of ``num_tokens`` computed tokens may read again."""
        return max(0, num_tokens - self.window - self.margin) // self.block_size

    def usable_prefix(self, cached: list[int]) -> int:
        """How many of the cached blocks a hit may use: the windowed layers of the next
        query must find every block of its window."""
        k = len(cached)
        while k and any(self.wmap[b] < 0 for b in cached[self._window_start(k):k]):
            k -= 1
        return k

    def _window_start(self, k: int) -> int:
        return max(0, k * self.block_size - self.window + 1) // self.block_size

    # -- acts (called by BlockManager) --------------------------------------------------
    def _give(self, b: int) -> None:
        if self.wmap[b] >= 0:
            self.retained.pop(b, None)
            return
        if not self.free_ids:
            if not self.retained:
                raise OutOfBlocksError("no window block free for the windowed layers")
            old, _ = self.retained.popitem(last=False)
            self._take_back(old)
        self.wmap[b] = self.free_ids.popleft()
        self.version += 1
        self.peak_used = max(self.peak_used, self.num_used)

    def _take_back(self, b: int) -> None:
        self.free_ids.append(self.wmap[b])
        self.wmap[b] = -1
        self.version += 1

    def _drop_need(self, b: int, *, keep: bool) -> None:
        self.need[b] -= 1
        if self.need[b] == 0 and self.wmap[b] >= 0:
            if keep:
                self.retained[b] = None
            else:
                self._take_back(b)

    def track(self, seq_id: int, table: list[int], num_tokens: int, new_from: int) -> None:
        """After ``seq_id`` grew to ``num_tokens`` over ``table`` (entries from ``new_from``
        on are fresh blocks): give the fresh ones window blocks, count the needed ones, and
        let go of those its window left behind. A needed block that is not fresh and has no
        window block lies in the margin only (never read): it is counted, not given one."""
        first = self.first_needed(num_tokens)
        old_first, upto = self.first.get(seq_id, (first, first))
        for j in range(old_first, min(first, upto)):
            self._drop_need(table[j], keep=False)
        first = max(first, old_first)
        for j in range(max(upto, first), len(table)):
            b = table[j]
            self.need[b] += 1
            if j >= new_from:
                self._give(b)
            elif self.wmap[b] >= 0:
                self.retained.pop(b, None)
        self.first[seq_id] = (first, max(len(table), first))

    def replace(self, seq_id: int, old: int, new: int) -> None:
        """Copy-on-write moved ``seq_id``'s last block from ``old`` to ``new``; ``old``'s
        window block stays until its rows are copied (the other sharers need it)."""
        if seq_id in self.first:
            self.need[new] += 1
            self._give(new)
            self._drop_need(old, keep=True)  # evictable: the copy still reads it

    def forget_block(self, b: int) -> None:
        """The prefix cache dropped ``b``: a retained window block goes back."""
        if b in self.retained:
            del self.retained[b]
            self._take_back(b)

    def release(self, seq_id: int, table: list[int], cached: set[int] | dict) -> None:
        """``seq_id`` ended: its needed blocks the prefix cache names are retained."""
        first, upto = self.first.pop(seq_id, (0, 0))
        for b in table[first:upto]:
            self._drop_need(b, keep=b in cached)

    def check_invariants(self, tables: dict[int, list[int]]) -> None:
        """Raise AssertionError if the window bookkeeping is inconsistent."""
        need = [0] * len(self.wmap)
        for seq_id, (first, upto) in self.first.items():
            assert upto <= len(tables[seq_id]), seq_id
            for b in tables[seq_id][first:upto]:
                need[b] += 1
        assert need == self.need, "window needs differ from the tables"
        held = [w for w in self.wmap if w >= 0]
        assert len(set(held)) == len(held) and 0 not in held, "a window block given twice"
        assert not set(held) & set(self.free_ids), "a window block both held and free"
        assert len(held) + len(self.free_ids) == self.num_window_blocks - 1
        for b, w in enumerate(self.wmap):
            assert (w >= 0) <= (need[b] > 0 or b in self.retained), f"block {b} leaks"
            assert (b in self.retained) <= (w >= 0 and need[b] == 0), f"block {b} retained"
