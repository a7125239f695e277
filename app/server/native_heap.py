"""Keep a long-running server's native heap from holding freed memory (glibc only).

Measured on `kvchat serve` (issue 33 item 5): glibc's mmap threshold is dynamic, rising to the
largest block freed (up to 32 MiB), so after the first few requests the big short-lived
buffers (prefill activations, JSON bodies, disk-entry reads) are carved from the arenas, and
what they free stays resident: ~100 MiB of free heap after 200 long prompts, and RSS going
up by steps. `tune` fixes the threshold at 128 KiB (glibc's default before it adapts):
larger blocks are mapped and unmapped. `Trimmer` returns the arenas' free pages
(``malloc_trim``) once the last in-flight request has ended, at most once a second. Elsewhere
(macOS) both do nothing.
"""

from __future__ import annotations

import asyncio
import threading
import time

from engine.model.memory import glibc, set_mmap_threshold

MMAP_THRESHOLD = 128 << 10
TRIM_EVERY_S = 1.0

_LIBC = glibc()


def available() -> bool:
    """Whether this process runs on glibc's malloc (what `tune` and `trim` act on)."""
    return _LIBC is not None


def tune() -> bool:
    """Fix glibc's mmap threshold for this process (and for after each prefill step, which
    raises it meanwhile: `memory.prefill_scratch_on_cpu`); True if done."""
    return _LIBC is not None and set_mmap_threshold(MMAP_THRESHOLD)


def trim() -> None:
    """Return free heap pages to the system now (glibc)."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


class Trimmer:
    """Counts requests in flight (on the event loop); when the last one ends, trims within
    ``every_s`` (at most once per ``every_s``, so a server going idle is always trimmed),
    on a thread of its own: ``malloc_trim`` walks every arena."""

    def __init__(self, every_s: float = TRIM_EVERY_S):
        self.every_s = every_s
        self.inflight = 0
        self.trims = 0
        self._last = 0.0
        self._due: asyncio.TimerHandle | None = None
        self._busy = threading.Lock()

    def started(self) -> None:
        self.inflight += 1

    def ended(self) -> None:
        self.inflight -= 1
        if _LIBC is None or self.inflight or self._due is not None:
            return
        delay = max(0.0, self._last + self.every_s - time.monotonic())
        self._due = asyncio.get_running_loop().call_later(delay, self._trim_if_idle)

    def _trim_if_idle(self) -> None:
        self._due = None
        if self.inflight:  # busy again: the next request to end schedules it
            return
        self._last = time.monotonic()
        if self._busy.acquire(blocking=False):  # one trim at a time
            threading.Thread(target=self._run, name="kvchat-trim", daemon=True).start()

    def _run(self) -> None:
        try:
            trim()
            self.trims += 1
        finally:
            self._busy.release()
