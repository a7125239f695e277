"""Joining the ranks, and never hanging on them: init and every collective under a watchdog.

MLX's collectives block until the peer answers; a rank that hangs (stopped, swapping,
deadlocked) would hang every other rank forever. So each blocking exchange runs inside
`Watchdog.guard`, and a daemon thread ends the process when a guard outlives its timeout.
A peer that dies instead closes its socket, and the ring backend raises at once: both ways
end in `fatal`, which runs the registered cleanups (rank 0 releases every request's blocks),
prints one clear line and exits with `EXIT_RANK_LOST`. Exiting is the only safe move: a
stuck collective cannot be cancelled from Python, and the ranks' pools are out of step.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import mlx.core as mx

from engine.errors import KVChatError

EXIT_RANK_LOST = 3  # a peer died or hung: distinct from the CLI's 2 (a user error)
BACKENDS = ("ring", "jaccl", "mpi", "nccl", "any")
_CLEANUP_S = 5.0  # a cleanup that blocks (a lock held by the stuck thread) is abandoned

_cleanups: list[Callable[[], str | None]] = []
_fatal_lock = threading.Lock()


def on_fatal(cleanup: Callable[[], str | None]) -> None:
    """Run ``cleanup`` before a fatal exit; a returned string is printed with the error."""
    _cleanups.append(cleanup)


def fatal(message: str, *, rank: int | None = None) -> None:
    """Clean up, print ``kvchat: error: distributed ...`` and exit the process now."""
    with _fatal_lock:  # the watchdog and the stepping thread may both get here
        notes: list[str] = []

        def run() -> None:
            for cleanup in list(_cleanups):
                try:
                    note = cleanup()
                except Exception as e:  # noqa: BLE001 - the exit must happen regardless
                    note = f"cleanup failed: {type(e).__name__}: {e}"
                if note:
                    notes.append(note)

        worker = threading.Thread(target=run, daemon=True)
        worker.start()
        worker.join(_CLEANUP_S)
        who = f" (rank {rank})" if rank is not None else ""
        line = f"kvchat: error: distributed{who}: {message}"
        if notes:
            line += "; " + "; ".join(notes)
        print(line + "; exiting", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(EXIT_RANK_LOST)


class Watchdog:
    """Ends the process when a guarded exchange takes longer than ``timeout_s``."""

    def __init__(self, timeout_s: float, *, rank: int | None = None):
        if not timeout_s > 0:
            raise ValueError("the distributed timeout must be positive")
        self.timeout_s = timeout_s
        self.rank = rank
        self._cond = threading.Condition()
        self._deadline: float | None = None
        self._what = ""
        self._started = 0.0
        threading.Thread(target=self._watch, name="kvchat-dist-watchdog", daemon=True).start()

    @contextmanager
    def guard(self, what: str, timeout_s: float | None = None) -> Iterator[None]:
        """Within the block, a stall past the timeout is fatal; nested guards keep the outer."""
        with self._cond:
            outer = self._deadline is not None
            if not outer:
                self._started = time.monotonic()
                self._deadline = self._started + (timeout_s or self.timeout_s)
                self._what = what
                self._cond.notify()
        try:
            yield
        finally:
            if not outer:
                with self._cond:
                    self._deadline = None
                    self._cond.notify()

    def _watch(self) -> None:
        with self._cond:
            while True:
                if self._deadline is None:
                    self._cond.wait()
                    continue
                left = self._deadline - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                waited = time.monotonic() - self._started
                what = self._what
                break
        fatal(f"no answer within {waited:.1f} s while {what}: a rank hung or died "
              f"(timeout {self.timeout_s:g} s)", rank=self.rank)


@contextmanager
def _alarm(timeout_s: float) -> Iterator[list[bool]]:
    """SIGALRM after ``timeout_s`` (main thread only): it interrupts a blocking socket call.

    `mx.distributed.init` holds the GIL while it waits for the peers, so no Python thread
    (the watchdog) runs; a signal makes its ``accept`` fail with EINTR instead.
    """
    fired: list[bool] = []
    if threading.current_thread() is not threading.main_thread():
        yield fired
        return
    previous = signal.signal(signal.SIGALRM, lambda *_: fired.append(True))
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        yield fired
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def init_group(backend: str = "ring", *, timeout_s: float = 120.0) -> mx.distributed.Group:
    """Join the ranks (``mlx.launch`` sets MLX_RANK / MLX_HOSTFILE), within ``timeout_s``.

    Raises:
        KVChatError: MLX has no such backend here, this process was not started as one
            of several ranks, or the other ranks did not connect in time.
    """
    if backend not in BACKENDS:
        raise KVChatError(f"unknown distributed backend {backend!r} "
                          f"(one of {', '.join(BACKENDS)})")
    if not mx.distributed.is_available(backend):
        raise KVChatError(f"MLX's {backend!r} distributed backend is not available here")
    hostfile = os.environ.get("MLX_HOSTFILE", "unset")
    try:
        with _alarm(timeout_s) as fired:
            group = mx.distributed.init(strict=True, backend=backend)
    except RuntimeError as e:
        if fired:
            raise KVChatError(f"the other ranks did not connect within {timeout_s:g} s "
                              f"({backend} backend, MLX_HOSTFILE={hostfile}): is every rank "
                              "started, and are the addresses reachable?") from None
        raise KVChatError(f"cannot start the {backend} backend: {e}; run the ranks under "
                          "mlx.launch (or set MLX_RANK and MLX_HOSTFILE)") from None
    if group.size() < 2:
        raise KVChatError("--distributed needs at least 2 ranks (mlx.launch -n 2 ...)")
    return group
