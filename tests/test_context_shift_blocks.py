"""The block side of a context shift (`engine.kvcache.context_shift`): refcounts, copy-on-write
of shared moved blocks, prefix names, and the pool's invariants under any mix of operations."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.errors import OutOfBlocksError
from engine.kvcache.block_manager import BlockManager
from engine.kvcache.context_shift import can_shift, plan_drop, shift


def test_exclusive_sequence_closes_up_behind_its_sinks():
    bm = BlockManager(16, 4)
    bm.allocate(1, 30)  # 8 blocks, the last one half full
    table = list(bm.block_tables[1])
    s = shift(bm, 1, sink=1, drop=3)
    assert bm.block_tables[1] == [table[0]] + table[4:]
    assert s.moved == table[4:] and s.copies == [] and s.delta == 12 and s.freed == 3
    assert bm.num_tokens[1] == 30 - 12
    assert set(table[1:4]) <= set(bm.free_block_ids)
    bm.check_invariants()
    # the next append continues in the (moved) last block: slots follow the shorter length
    plan = bm.append(1, 1)
    assert plan.slots == [table[-1] * 4 + 2]
    bm.free(1)
    assert bm.num_free_blocks == bm.num_blocks
    bm.check_invariants()


def test_shared_blocks_are_dereferenced_or_copied_never_moved():
    bm = BlockManager(32, 4)
    bm.allocate(1, 24)  # 6 full blocks
    bm.fork(1, 2)  # sequence 2 shares all six
    before = list(bm.block_tables[1])
    s = shift(bm, 1, sink=1, drop=2)
    assert bm.block_tables[2] == before  # the sharer sees nothing change
    assert [src for src, _ in s.copies] == before[3:]  # shared moved blocks are copied
    assert s.moved == [dst for _, dst in s.copies] == bm.block_tables[1][1:]
    assert not set(s.moved) & set(before)
    assert s.freed == 0  # dropped blocks are still held by sequence 2
    assert [bm.ref_counts[b] for b in before] == [2, 1, 1, 1, 1, 1]
    bm.check_invariants()
    bm.free(1)
    bm.free(2)
    assert bm.num_free_blocks == bm.num_blocks
    bm.check_invariants()


def test_moved_blocks_lose_their_prefix_names_dropped_ones_keep_them():
    bm = BlockManager(16, 4)
    bm.allocate(1, 20)
    table = list(bm.block_tables[1])
    for i, b in enumerate(table):
        bm.register(b, bytes([i]) * 8, [i] * 4)
    shift(bm, 1, sink=1, drop=2)
    assert table[0] in bm.block_hash  # the sink's K/V is still its prefix's
    assert all(b in bm.block_hash for b in table[1:3])  # dropped: unchanged, now cached
    assert all(b in bm.evictable for b in table[1:3])
    assert not any(b in bm.block_hash for b in table[3:])  # re-rotated: no longer named
    assert bm.lookup([bytes([0]) * 8, bytes([1]) * 8], [[0] * 4, [1] * 4]) == table[:2]
    assert bm.lookup([bytes([3]) * 8], [[3] * 4]) == []
    bm.check_invariants()


def test_plan_drop_and_refusals():
    assert plan_drop(16, 1) == 7 and plan_drop(3, 1) == 1 and plan_drop(2, 1) == 0
    bm = BlockManager(6, 4)
    bm.allocate(1, 8)
    assert not can_shift(bm, 1, 1, 1)  # nothing would stay after the dropped block
    with pytest.raises(OutOfBlocksError):
        shift(bm, 1, 1, 1)
    bm.allocate(2, 12)
    bm.fork(2, 3)  # a full pool: 2 + 3 blocks, 1 free
    assert bm.num_free_blocks == 1
    # sequence 3's moved blocks are shared with 2: two copies, one block free and nothing
    # freed by the drop (sequence 2 holds the dropped block too)
    assert not can_shift(bm, 3, 0, 1)
    bm.check_invariants()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["new", "grow", "fork", "shift", "free"]),
                          st.integers(0, 5), st.integers(1, 9)), max_size=40))
def test_any_mix_keeps_the_pool_consistent(ops):
    bm = BlockManager(40, 4)
    live: list[int] = []
    for next_id, (op, pick, n) in enumerate(ops):
        seq = live[pick % len(live)] if live else None
        if op == "new" and bm.can_allocate(n):
            bm.allocate(next_id, n)
            live.append(next_id)
        elif op == "fork" and seq is not None:
            bm.fork(seq, next_id)
            live.append(next_id)
        elif op == "grow" and seq is not None and bm.can_append(seq, n):
            bm.append(seq, n)
            full = bm.num_tokens[seq] // 4
            for i, b in enumerate(bm.block_tables[seq][:full]):  # name full blocks
                bm.register(b, bytes([seq % 256, i]) * 4, [i] * 4)
        elif op == "shift" and seq is not None:
            sink = pick % 2
            drop = plan_drop(len(bm.block_tables[seq]), sink)
            if drop and can_shift(bm, seq, sink, drop):
                before = bm.num_tokens[seq]
                s = shift(bm, seq, sink, drop)
                assert bm.num_tokens[seq] == before - s.delta
                assert all(bm.ref_counts[b] == 1 and b not in bm.block_hash for b in s.moved)
        elif op == "free" and seq is not None:
            bm.free(seq)
            live.remove(seq)
        bm.check_invariants()
    for seq in live:
        bm.free(seq)
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks  # free + cached == total: nothing leaked
