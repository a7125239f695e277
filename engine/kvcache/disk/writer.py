"""A bounded queue and one daemon thread: the disk store's writes, off the decode loop."""

from __future__ import annotations

import contextlib
import os
import queue
import sys
import threading
from collections.abc import Callable

WRITER_NICE = 10
"""How much nicer than the engine the writer thread runs (Linux): persisting blocks must
not take a core from decode on a small machine (2 cores: the bench's decode was 29 tok/s
with the disk cache on against 40 off, before this and the batched block read-back)."""


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
    """

    def __init__(self, write: Callable[..., object], max_pending: int,
                 name: str = "kvchat-prefix-writer"):
        self._write, self._name = write, name
        self._queue: queue.Queue = queue.Queue(max_pending)
        self._idle = threading.Condition()  # guards the fields below; notified per item done
        self._pending = 0  # queued or being written
        self._thread: threading.Thread | None = None
        self._closed = False
        self.dropped = 0
        """Items refused: the queue was full or the writer closed."""
        self.failed = 0
        """Items whose ``write`` raised."""

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
                self._queue.put_nowait(item)
            except queue.Full:
                self.dropped += 1
                return False
            self._pending += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
        return True

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every submitted item is done; False if ``timeout`` ran out first."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    def close(self) -> None:
        """Finish the queued items and stop the thread; later submits are dropped."""
        with self._idle:
            thread = None if self._closed else self._thread
            self._closed = True
        if thread is not None:
            self._queue.put(None)
            thread.join()

    def _run(self) -> None:
        lower_thread_priority()
        while (item := self._queue.get()) is not None:
            failed = False
            try:
                self._write(*item)
            except Exception:
                failed = True
            with self._idle:
                self._pending -= 1
                self.failed += int(failed)
                self._idle.notify_all()
