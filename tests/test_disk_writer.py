"""The disk store's background writer on its own: order, bounds, failures, close."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest

from engine.kvcache.disk_writer import WRITER_NICE, BackgroundWriter


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
