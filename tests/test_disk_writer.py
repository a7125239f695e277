"""The disk store's background writer: on its own (order, bounds, failures, close) and behind
the store's `put_async`."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest
from disk_blocks import Clock, get, make_block, same

from engine.kvcache.disk.store import DiskPrefixStore
from engine.kvcache.disk.writer import WRITER_NICE, BackgroundWriter


def test_runs_items_in_order_off_the_calling_thread():
    seen, threads = [], set()

    def write(i):
        seen.append(i)
        threads.add(threading.current_thread().name)

    w = BackgroundWriter(write, max_pending=100, name="test-writer")
    assert all(w.submit((i,)) for i in range(20))
    assert w.flush(timeout=10) and w.pending == 0
    assert seen == list(range(20)) and threads == {"test-writer"}
    w.close()


def test_full_queue_drops_without_blocking_and_failures_are_counted():
    gate, entered = threading.Event(), threading.Event()

    def write(i):
        entered.set()
        gate.wait(10)
        if i == 1:
            raise ValueError("a malformed block")

    w = BackgroundWriter(write, max_pending=2)
    assert w.submit((0,))
    assert entered.wait(10)  # item 0 is being written; the queue is empty
    assert w.submit((1,)) and w.submit((2,))
    t = time.perf_counter()
    assert not w.submit((3,))
    assert time.perf_counter() - t < 0.5
    assert (w.dropped, w.pending) == (1, 3)
    assert not w.flush(timeout=0.05)
    gate.set()
    assert w.flush(timeout=10)
    assert (w.failed, w.pending) == (1, 0)  # and the thread carried on after the failure
    w.close()


def test_close_drains_then_drops():
    seen = []
    w = BackgroundWriter(lambda i: (time.sleep(0.01), seen.append(i)), max_pending=10)
    for i in range(5):
        w.submit((i,))
    w.close()
    assert seen == list(range(5))
    assert not w.submit((9,)) and w.dropped == 1
    w.close()  # twice is harmless


def test_no_thread_until_the_first_item():
    before = threading.active_count()
    w = BackgroundWriter(lambda: None, max_pending=1)
    assert threading.active_count() == before
    w.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")
def test_writer_thread_runs_nicer_than_its_caller():
    niceness = []
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    def write():
        niceness.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    w = BackgroundWriter(write, max_pending=4)
    assert w.submit(()) and w.flush(timeout=10)
    w.close()
    assert niceness == [min(19, mine + WRITER_NICE)]
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine  # only its own


def wait_until(cond, timeout=10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return False


def test_hold_keeps_items_waiting_until_it_lifts():
    busy, seen = threading.Event(), []
    busy.set()
    w = BackgroundWriter(seen.append, max_pending=8, hold=busy.is_set, max_hold_s=60)
    assert w.submit((1,)) and w.submit((2,))
    time.sleep(0.3)
    assert seen == [] and w.pending == 2  # the engine is computing: nothing written
    busy.clear()
    assert wait_until(lambda: seen == [1, 2])  # idle: written without a flush
    assert w.held == 1 and w.pending == 0  # only the first waited; the second found it idle
    w.close()


def test_a_held_item_is_written_after_max_hold_s():
    seen = []
    w = BackgroundWriter(seen.append, max_pending=8, hold=lambda: True, max_hold_s=0.3)
    t = time.monotonic()
    assert w.submit((1,))
    assert wait_until(lambda: seen == [1])
    assert time.monotonic() - t >= 0.3 and w.held == 1
    w.close()


def test_flush_and_close_lift_the_hold():
    seen = []
    w = BackgroundWriter(seen.append, max_pending=8, hold=lambda: True, max_hold_s=600)
    assert w.submit((1,))
    t = time.monotonic()
    assert w.flush(timeout=10) and seen == [1]
    assert time.monotonic() - t < 5
    assert w.submit((2,)) and w.submit((3,))
    w.close()  # drains what is held
    assert seen == [1, 2, 3] and time.monotonic() - t < 5


def test_a_half_full_queue_is_not_held():
    seen = []
    w = BackgroundWriter(seen.append, max_pending=4, hold=lambda: True, max_hold_s=600)
    assert w.submit((0,))
    time.sleep(0.2)
    assert seen == []
    assert w.submit((1,)) and w.submit((2,))  # 2 of 4 queued behind the held one
    assert wait_until(lambda: seen == [0])  # written now, or new blocks would be dropped
    time.sleep(0.2)
    assert seen == [0] and w.pending == 2  # one queued again: held again
    w.close()
    assert seen == [0, 1, 2]


def test_a_failing_hold_does_not_stop_the_writes():
    seen = []

    def hold():
        raise RuntimeError("the engine went away")

    w = BackgroundWriter(seen.append, max_pending=4, hold=hold, max_hold_s=600)
    assert w.submit((1,))
    assert wait_until(lambda: seen == [1])
    w.close()


# ---- behind the store ------------------------------------------------------------------------


@pytest.fixture
def store(tmp_path):
    s = DiskPrefixStore(tmp_path / "prefix", clock=Clock())
    yield s
    s.close()


def test_put_async_and_flush(store):
    blocks = [make_block(100 + i) for i in range(6)]
    for b in blocks:
        assert store.put_async(b.salt, b.hash, b.parent, b.tokens, b.arrays)
    assert store.flush(timeout=10)
    s = store.stats()
    assert (s.writes, s.pending_writes, s.dropped_writes) == (6, 0, 0)
    assert all(same(get(store, b), b.arrays) for b in blocks)
    assert not store.put_async(blocks[0].salt, blocks[0].hash, blocks[0].parent,
                               blocks[0].tokens, blocks[0].arrays)  # already stored
    store.close()
    late = make_block(120)
    assert not store.put_async(late.salt, late.hash, late.parent, late.tokens, late.arrays)
    assert store.stats().dropped_writes == 1


class GatedClock(Clock):
    """Blocks the writer thread inside put() until the gate opens."""

    def __init__(self):
        super().__init__()
        self.gate, self.entered = threading.Event(), threading.Event()

    def __call__(self) -> float:
        if threading.current_thread() is not threading.main_thread():
            self.entered.set()
            self.gate.wait(10)
        return self.t


def test_full_queue_drops_writes_without_blocking(tmp_path):
    clock = GatedClock()
    store = DiskPrefixStore(tmp_path / "p", max_pending=2, clock=clock)
    blocks = [make_block(130 + i) for i in range(4)]

    def put_async(b):
        return store.put_async(b.salt, b.hash, b.parent, b.tokens, b.arrays)

    assert put_async(blocks[0])
    assert clock.entered.wait(10)  # the writer holds block 0; the queue is empty
    assert put_async(blocks[1]) and put_async(blocks[2])
    t = time.perf_counter()
    assert not put_async(blocks[3])
    assert time.perf_counter() - t < 0.5
    assert not store.flush(timeout=0.05)
    s = store.stats()
    assert (s.dropped_writes, s.pending_writes) == (1, 3)
    clock.gate.set()
    assert store.flush(timeout=10)
    assert [store.contains(b.hash) for b in blocks] == [True, True, True, False]
    store.close()


def test_malformed_async_write_counts_an_error(store):
    b = make_block(140)
    assert store.put_async(b.salt, b"\x01" * 32, b.parent, b.tokens, b.arrays)
    assert store.flush(timeout=10)
    assert store.stats().write_errors == 1
    assert store.put_async(b.salt, b.hash, b.parent, b.tokens, b.arrays)  # writer still alive
    assert store.flush(timeout=10) and store.contains(b.hash)
