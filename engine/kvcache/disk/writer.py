"""A bounded queue and one daemon thread: the disk store's writes, off the decode loop."""

from __future__ import annotations

import contextlib
import os
import queue
import sys
import threading
import time
from collections.abc import Callable

WRITER_NICE = 10
"""How much nicer than the engine the writer thread runs (Linux): persisting blocks must
not take a core from decode on a small machine (2 cores: the bench's decode was 29 tok/s
with the disk cache on against 40 off, before this and the batched block read-back)."""

MAX_HOLD_S = 10.0
"""How long a write may wait for its ``hold`` to lift (the engine to go idle): a niced
thread still took ~40 ms of CPU for a 1B model's 512-token prompt (32 blocks: SHA-256,
copies, fsyncs), which the decode right after it lost on 2 cores. Past this, it writes
anyway, so a server that is never idle still fills its disk cache."""
HOLD_POLL_S = 0.05  # how often a held write asks again


def lower_thread_priority(nice: int = WRITER_NICE) -> None:
    """Raise the calling thread's nice value by ``nice`` where the OS has per-thread
    priorities (Linux); elsewhere nothing changes."""
    if not hasattr(os, "setpriority") or not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError):
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))


class BackgroundWriter:
    """Runs ``write(*item)`` for submitted items, in order, on one lazily started thread.

    `submit` never blocks: a full queue or a closed writer drops the item. An exception
    from ``write`` is counted and the thread carries on (one bad block must not stop the
    others).

    Args:
        write (Callable[..., object]): called with each item's fields.
        max_pending (int): the queue's bound (each item holds a whole block).
        name (str): the thread's name.
        hold (Callable[[], bool], optional): while it returns True (the engine is
            computing), an item waits, up to ``max_hold_s`` after it was submitted; `flush`,
            `close` and a queue half full lift it.
        max_hold_s (float): the longest an item waits for ``hold``.
    """

    def __init__(self, write: Callable[..., object], max_pending: int,
                 name: str = "kvchat-prefix-writer", *,
                 hold: Callable[[], bool] | None = None, max_hold_s: float = MAX_HOLD_S):
        self._write, self._name = write, name
        self.hold, self.max_hold_s = hold, max_hold_s
        self._urgent = 0  # flushes waiting: nothing is held meanwhile
        self._queue: queue.Queue = queue.Queue(max_pending)
        self._idle = threading.Condition()  # guards the fields below; notified per item done
        self._pending = 0  # queued or being written
        self._thread: threading.Thread | None = None
        self._closed = False
        self.dropped = 0
        """Items refused: the queue was full or the writer closed."""
        self.failed = 0
        """Items whose ``write`` raised."""
        self.held = 0
        """Items that waited for ``hold`` to lift before they were written."""

    @property
    def pending(self) -> int:
        """Items queued or being written."""
        with self._idle:
            return self._pending

    def submit(self, item: tuple) -> bool:
        """Queue ``item``; False (and counted in ``dropped``) if full or closed."""
        with self._idle:
            # Under the lock, so nothing is queued behind close()'s end marker.
            if self._closed:
                self.dropped += 1
                return False
            try:
                self._queue.put_nowait((time.monotonic(), item))
            except queue.Full:
                self.dropped += 1
                return False
            self._pending += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
        return True

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every submitted item is done (none held meanwhile); False if
        ``timeout`` ran out first."""
        with self._idle:
            self._urgent += 1
            self._idle.notify_all()
            try:
                return self._idle.wait_for(lambda: self._pending == 0, timeout)
            finally:
                self._urgent -= 1

    def close(self) -> None:
        """Finish the queued items and stop the thread; later submits are dropped."""
        with self._idle:
            thread = None if self._closed else self._thread
            self._closed = True
            self._idle.notify_all()  # a held item is written now
        if thread is not None:
            self._queue.put(None)
            thread.join()

    def _run(self) -> None:
        lower_thread_priority()
        while (entry := self._queue.get()) is not None:
            queued_at, item = entry
            self._wait_for_idle(queued_at)
            failed = False
            try:
                self._write(*item)
            except Exception:
                failed = True
            with self._idle:
                self._pending -= 1
                self.failed += int(failed)
                self._idle.notify_all()

    def _wait_for_idle(self, queued_at: float) -> None:
        """Wait while ``hold`` says so, at most until ``max_hold_s`` after ``queued_at``."""
        if self.hold is None:
            return
        deadline, waited = queued_at + self.max_hold_s, False
        with self._idle:
            # a queue half full writes now: held longer, new blocks would be dropped
            while not (self._closed or self._urgent
                       or 2 * self._queue.qsize() >= self._queue.maxsize > 0):
                left = deadline - time.monotonic()
                try:
                    if left <= 0 or not self.hold():
                        break
                except Exception:  # a broken probe must not stop the writes
                    break
                waited = True
                self._idle.wait(min(HOLD_POLL_S, left))
            self.held += int(waited)
