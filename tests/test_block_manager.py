"""Property tests of the block pool's bookkeeping (DESIGN.md invariants)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from engine.errors import OutOfBlocksError
from engine.kvcache.block_manager import BlockManager
from engine.kvcache.window_blocks import WindowBlocks


class PoolMachine(RuleBasedStateMachine):
    """Random allocate / append / fork / free / prefix reuse against a shadow model.

    Cached blocks are reused by reference and evicted under pressure; the
    shadow contents prove a cached or shared block is never overwritten.
    """

    @initialize(num_blocks=st.integers(1, 24), block_size=st.sampled_from([1, 2, 4, 16]))
    def setup(self, num_blocks, block_size):
        self.bm = BlockManager(num_blocks, block_size)
        self.next_id = 0
        # shadow contents: per sequence, the token "values" it stored, and what
        # each physical slot holds, to prove shared blocks are never overwritten
        self.tokens: dict[int, list[int]] = {}
        self.slot_values: dict[int, int] = {}
        self.counter = 0
        self.prefixes: set[tuple[int, ...]] = set()

    def _write(self, seq, plan, n):
        for src, dst in plan.copies:  # copy-on-write happens before the write
            bs = self.bm.block_size
            for i in range(bs):
                if src * bs + i in self.slot_values:
                    self.slot_values[dst * bs + i] = self.slot_values[src * bs + i]
        for slot in plan.slots:
            self.counter += 1
            self.slot_values[slot] = self.counter
            self.tokens[seq].append(self.counter)
        assert len(plan.slots) == n

    @rule(n=st.integers(0, 40))
    def allocate(self, n):
        seq = self.next_id
        self.next_id += 1
        free_before = self.bm.num_free_blocks
        if self.bm.can_allocate(n):
            self.tokens[seq] = []
            self._write(seq, self.bm.allocate(seq, n), n)
        else:
            with pytest.raises(OutOfBlocksError):
                self.bm.allocate(seq, n)
            assert self.bm.num_free_blocks == free_before  # a failed allocation takes nothing
            assert seq not in self.bm.block_tables

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), n=st.integers(0, 20))
    def append(self, data, n):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        if self.bm.can_append(seq, n):
            self._write(seq, self.bm.append(seq, n), n)
        else:
            before = (list(self.bm.block_tables[seq]), self.bm.num_free_blocks)
            with pytest.raises(OutOfBlocksError):
                self.bm.append(seq, n)
            assert before == (self.bm.block_tables[seq], self.bm.num_free_blocks)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.tokens)))
        child = self.next_id
        self.next_id += 1
        self.bm.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), twice=st.booleans())
    def free(self, data, twice):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        self.bm.free(seq)
        if twice:  # every release path may call free; the second is a no-op
            assert self.bm.free(seq) == 0
        del self.tokens[seq]

    @staticmethod
    def _key(values) -> bytes:  # stands in for the chained hash: names the whole prefix
        return repr(tuple(values)).encode()

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def register_full_blocks(self, data):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        bs, values = self.bm.block_size, self.tokens[seq]
        for i in range(len(values) // bs):
            block = self.bm.block_tables[seq][i]
            self.bm.register(block, self._key(values[: (i + 1) * bs]), values[i * bs:(i + 1) * bs])
            self.prefixes.add(tuple(values[: (i + 1) * bs]))

    @precondition(lambda self: self.prefixes)
    @rule(data=st.data())
    def reuse_cached_prefix(self, data):
        values = data.draw(st.sampled_from(sorted(self.prefixes)))
        bs = self.bm.block_size
        n = len(values) // bs
        keys = [self._key(values[: (i + 1) * bs]) for i in range(n)]
        hit = self.bm.lookup(keys, [values[i * bs:(i + 1) * bs] for i in range(n)])
        seq = self.next_id
        self.next_id += 1
        self.bm.allocate_cached(seq, hit)
        self.tokens[seq] = list(values[: len(hit) * bs])  # must read back the cached values

    @rule()
    def drop_cached(self):
        cached = self.bm.num_cached_blocks
        assert self.bm.drop_cached() == cached and self.bm.num_cached_blocks == 0

    @invariant()
    def bookkeeping_is_consistent(self):
        self.bm.check_invariants()

    @invariant()
    def every_sequence_reads_back_its_own_tokens(self):
        bs = self.bm.block_size
        for seq, values in self.tokens.items():
            table = self.bm.block_tables[seq]
            got = [self.slot_values[table[t // bs] * bs + t % bs] for t in range(len(values))]
            assert got == values, f"sequence {seq} sees another sequence's writes"

    @invariant()
    def free_plus_used_is_total(self):
        assert self.bm.num_free_blocks + self.bm.num_used_blocks == self.bm.num_blocks
        if not self.tokens:
            assert self.bm.num_free_blocks == self.bm.num_blocks


TestPool = PoolMachine.TestCase
TestPool.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


class WindowPoolMachine(PoolMachine):
    """The same operations with sliding-window layers on their own smaller store: every
    sequence still reads back, through ``wmap``, every token its next query's window
    sees, and the window store's bookkeeping stays consistent."""

    @initialize(num_blocks=st.integers(1, 24), block_size=st.sampled_from([1, 2, 4]),
                window=st.sampled_from([1, 2, 5, 9]), margin=st.sampled_from([0, 3]),
                window_blocks=st.integers(2, 30))
    def setup(self, num_blocks, block_size, window, margin, window_blocks):
        super().setup(num_blocks, block_size)
        self.wb = WindowBlocks(num_blocks, window_blocks, block_size, window, margin)
        self.bm = BlockManager(num_blocks, block_size, self.wb)
        self.window_values: dict[int, int] = {}

    def _wslot(self, slot: int) -> int | None:
        bs = self.bm.block_size
        w = self.wb.wmap[slot // bs]
        return w * bs + slot % bs if w > 0 else None

    def _write(self, seq, plan, n):
        bs = self.bm.block_size
        for src, dst in plan.copies:
            for i in range(bs):
                a, b = self._wslot(src * bs + i), self._wslot(dst * bs + i)
                if a is not None and b is not None and a in self.window_values:
                    self.window_values[b] = self.window_values[a]
        counter = self.counter
        super()._write(seq, plan, n)
        for k, slot in enumerate(plan.slots):
            w = self._wslot(slot)
            if w is not None:
                self.window_values[w] = counter + k + 1

    @invariant()
    def every_window_reads_back(self):
        bs, W = self.bm.block_size, self.wb.window
        for seq, values in self.tokens.items():
            n, table = len(values), self.bm.block_tables[seq]
            for p in range(max(0, n - W + 1), n):
                w = self._wslot(table[p // bs] * bs + p % bs)
                assert w is not None, f"sequence {seq} lost position {p} of its window"
                assert self.window_values.get(w) == values[p], f"sequence {seq} at {p}"


TestWindowPool = WindowPoolMachine.TestCase
TestWindowPool.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


@given(n=st.integers(0, 200), bs=st.integers(1, 32))
def test_blocks_held_are_ceil_and_waste_is_under_one_block(n, bs):
    bm = BlockManager(64, bs)
    if not bm.can_allocate(n):
        return
    bm.allocate(0, n)
    held = len(bm.block_tables[0])
    assert held == -(-n // bs)
    assert held * bs - n < bs


def test_copy_on_write_of_shared_partial_block():
    bm = BlockManager(8, 4)
    bm.allocate(1, 6)  # blocks [a, b], b half full
    bm.fork(1, 2)
    a, b = bm.block_tables[1]
    assert bm.ref_counts[b] == 2
    plan = bm.append(2, 1)
    new_b = bm.block_tables[2][1]
    assert plan.copies == [(b, new_b)] and new_b != b
    assert bm.block_tables[1] == [a, b]  # the parent keeps the original
    assert bm.ref_counts[b] == 1 and bm.ref_counts[a] == 2
    assert plan.slots == [new_b * 4 + 2]
    bm.check_invariants()


def test_full_shared_blocks_are_not_copied():
    bm = BlockManager(8, 4)
    bm.allocate(1, 8)
    bm.fork(1, 2)
    plan = bm.append(2, 1)
    assert plan.copies == []
    assert bm.block_tables[2][:2] == bm.block_tables[1]
    bm.check_invariants()


def test_free_releases_exactly_once():
    bm = BlockManager(4, 4)
    bm.allocate(1, 9)
    assert bm.free(1) == 3
    assert bm.free(1) == 0
    assert bm.num_free_blocks == 4
    bm.check_invariants()


def test_cached_blocks_are_evicted_lru_and_counted():
    bm = BlockManager(4, 2)
    for seq, toks in ((1, [1, 2, 3, 4]), (2, [5, 6])):
        bm.allocate(seq, len(toks))
        for i in range(len(toks) // 2):
            bm.register(bm.block_tables[seq][i], bytes([seq, i]), toks[2 * i:2 * i + 2])
    bm.free(1)  # its two blocks become cached (LRU order: block of [1,2] first)
    bm.free(2)
    assert bm.num_cached_blocks == 3 and bm.num_free_blocks == 4 and bm.num_used_blocks == 0
    assert bm.lookup([bytes([1, 0]), bytes([1, 1])], [[1, 2], [3, 4]]) == [0, 1]
    assert bm.lookup([bytes([1, 0])], [[9, 9]]) == []  # same key, other tokens: a miss
    bm.allocate(3, 4)  # one free block, then evicts the least recently used cached one
    assert bm.evictions == 1 and bm.lookup([bytes([1, 0])], [[1, 2]]) == []
    assert bm.lookup([bytes([2, 0])], [[5, 6]]) == [2]
    bm.check_invariants()
