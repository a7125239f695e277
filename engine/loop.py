"""The engine's step loop and its thread: inbox, request table, cancels, events, shutdown.

`EngineLoop` is the threading half of `Engine`: it runs `_step` on a background
thread (`start`) or in the consumer that waits for an event, applies cancels
within one step, and orders queueing (`_enqueue`, behind `submit`) and `shutdown`
under one lock so nothing is served after `shutdown` returns. Subclasses provide
`_step`, `_finish`, `_close` and a `scheduler` with `has_work`.
"""

from __future__ import annotations

import queue
import threading
import time

from engine.errors import EngineStoppedError
from engine.generation import GenerationEvent
from engine.request import Request, RequestState


class EngineLoop:
    """Runs engine steps on one thread at a time; thread-safe cancel and shutdown."""

    def __init__(self):
        self._lock = threading.RLock()  # guards the inbox, cancels, the request table, _stopped
        self._step_lock = threading.RLock()  # one step at a time
        self._wake = threading.Condition(self._lock)
        self._inbox: list[Request] = []
        self._cancels: dict[int, float] = {}
        self._requests: dict[int, Request] = {}
        self._thread: threading.Thread | None = None
        self._stopped = False
        self._in_step = False  # a cancel from inside a step waits for the next one

    # -- provided by the engine --------------------------------------------------------
    scheduler = None

    def _step(self) -> None:
        raise NotImplementedError

    def _finish(self, req: Request, reason: str, *, error: str | None = None) -> None:
        raise NotImplementedError

    def _close(self) -> None:
        """Release what outlives requests (the disk writer); called once by `shutdown`."""

    def _settle(self) -> None:
        """Finish the calling thread's queued MLX work (the engine thread, as it ends)."""

    # -- the request table -------------------------------------------------------------
    def _enqueue(self, req: Request) -> None:
        """Queue a checked request for the next step; raises `EngineStoppedError` once
        `shutdown` has begun (under the lock it takes, so nothing is queued after it)."""
        with self._wake:
            if self._stopped:
                raise EngineStoppedError("the engine has shut down")
            self._requests[req.request_id] = req
            self._inbox.append(req)
            self._wake.notify()

    def request_state(self, request_id: int) -> RequestState:
        """WAITING, RUNNING, SWAPPED, or FINISHED (also for unknown ids)."""
        with self._lock:
            req = self._requests.get(request_id)
        return req.state if req is not None else RequestState.FINISHED

    def live_requests(self) -> int:
        """Requests submitted and not yet finished."""
        with self._lock:
            return len(self._requests)

    # -- cancels ---------------------------------------------------------------------
    def _unwanted(self, reqs: list[Request]) -> bool:
        """True when every one of ``reqs`` is cancelled or finished, or the engine stops:
        their forward may stop early (checked between layer groups)."""
        with self._lock:
            return self._stopped or all(r.finished or r.request_id in self._cancels
                                        for r in reqs)

    def cancel(self, request_id: int) -> bool:
        """Cancel a request; it ends within one step. False if unknown or already done."""
        with self._wake:
            req = self._requests.get(request_id)
            if req is None or req.finished:
                return False
            self._cancels.setdefault(request_id, time.perf_counter())
            self._wake.notify()
            threaded = self._thread is not None and self._thread.is_alive()
        if not threaded and not self._in_step:  # nobody else will step soon: release now
            with self._step_lock:
                self._apply_cancels()
        return True

    def _apply_cancels(self) -> None:
        with self._lock:
            cancels, self._cancels = self._cancels, {}
        for rid, at in cancels.items():
            req = self._requests.get(rid)
            if req is not None:
                req.cancel_at = at
                self._finish(req, "cancelled")

    # -- events ----------------------------------------------------------------------
    def _next_event(self, req: Request) -> GenerationEvent:
        """The request's next event; drives steps itself when no engine thread runs."""
        while True:
            try:
                return req.events.get_nowait()
            except queue.Empty:
                pass
            if req.finished and req.events.empty():
                raise RuntimeError(f"request {req.request_id} has finished and its final "
                                   "event was already read")
            thread = self._thread
            if thread is not None and thread.is_alive():
                try:
                    return req.events.get(timeout=0.5)
                except queue.Empty:
                    continue
            self.step()

    # -- the step loop -----------------------------------------------------------------
    def start(self) -> None:
        """Run steps on a background thread until `shutdown` (idempotent)."""
        with self._lock:
            if self._stopped or (self._thread is not None and self._thread.is_alive()):
                return
            self._thread = threading.Thread(target=self._loop, name="kvchat-engine",
                                            daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        try:
            while True:
                with self._wake:
                    while not (self._stopped or self._inbox or self._cancels
                               or self.scheduler.has_work):
                        self._wake.wait()
                    if self._stopped:
                        return
                self.step()
        finally:
            # MLX streams are per thread: work this thread queued (a launched decode, the
            # K/V writes behind its tokens) must end before the thread and its stream do
            self._settle()

    def _fail_all(self, error: str) -> None:
        with self._step_lock:
            with self._lock:
                live = list(self._requests.values())
            for req in live:
                self._finish(req, "error", error=error)

    def step(self) -> None:
        """One engine step: take in requests and cancels, plan, run, release."""
        with self._step_lock:
            if self._stopped:
                return
            self._in_step = True
            try:
                self._step()
            except Exception as e:  # noqa: BLE001 - a bug in a step must not strand requests
                # on the engine thread or in whichever consumer drove the step: every live
                # request ends with the error, and the engine goes on
                self._fail_all(f"engine step failed: {type(e).__name__}: {e}")
            finally:
                self._in_step = False

    def shutdown(self) -> None:
        """Finish every request ("shutdown"), release all blocks, stop the thread."""
        with self._wake:
            already, self._stopped = self._stopped, True
            self._wake.notify_all()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        with self._step_lock:
            with self._lock:
                pending = list(self._requests.values())
                self._inbox.clear()
            for req in pending:
                self._finish(req, "shutdown")
        if not already:
            self._close()
