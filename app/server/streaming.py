"""From the engine's thread to the event loop, and from a closed socket back to a cancel.

The engine runs on its own thread and queues each request's events; reading a handle
blocks. The event loop must never block, so one `EventPump` task looks at every live
handle's ``ready`` flag each few milliseconds and wakes the coroutine that owns it: one
timer for all requests, not one per request, which matters on a two-core machine with
64 streams. A consumer that stops early (its task cancelled, its generator closed)
cancels its request on the way out, so its blocks come back within one engine step.

`EventStreamResponse` sends server-sent events and watches the connection at the same
time: the moment the client disconnects (also before the first token, while the prompt
is still being prefilled and nothing has been sent), the request is cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Callable

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from engine.generation import GenerationEvent
from engine.request import RequestHandle

POLL_S = 0.004  # adds at most this to each token's latency; a CPU decode step is ~50 ms


class EventPump:
    """Delivers engine events to asyncio consumers without blocking the event loop.

    A handle its consumer abandoned (the client left) is cancelled and kept until its
    final event arrives, so nothing it queued is left behind. (The engine records each
    cancel's release latency itself, when it frees the blocks.)
    """

    def __init__(self, interval_s: float = POLL_S):
        self.interval_s = interval_s
        self._live: dict[int, tuple[RequestHandle, asyncio.Event]] = {}
        self._abandoned: dict[int, RequestHandle] = {}
        self._task: asyncio.Task | None = None

    @property
    def num_live(self) -> int:
        """Requests being consumed right now."""
        return len(self._live)

    async def events(self, handle: RequestHandle) -> AsyncIterator[GenerationEvent]:
        """The request's events up to its final one; leaving early cancels the request.
        Tokens already waiting when one is read come with it, as one event (its text
        joined): a speculative step yields several at once."""
        wake = asyncio.Event()
        self._abandoned.pop(handle.request_id, None)  # this consumer reads the end itself
        self._live[handle.request_id] = (handle, wake)
        self._ensure_running()
        try:
            while True:
                event = handle.poll()
                if event is None:
                    wake.clear()
                    if not handle.ready:  # it may have become ready since poll()
                        await wake.wait()
                    continue
                while event.finish_reason is None and event.token is not None and (
                        handle.ready):  # tokens of one step (accepted drafts): one event
                    more = handle.poll()
                    event = dataclasses.replace(more, text=event.text + more.text, logprobs=(
                        event.logprobs + more.logprobs if event.logprobs and more.logprobs
                        else event.logprobs or more.logprobs))
                yield event
                if event.finish_reason is not None:
                    return
        finally:
            self._live.pop(handle.request_id, None)
            self.abandon(handle)

    def abandon(self, handle: RequestHandle) -> bool:
        """Cancel a request nobody will read to the end; its blocks come back within a
        step, and its final event is read here. True if it had not finished yet."""
        if handle.done:
            return False
        cancelled = handle.cancel()
        if handle.request_id not in self._live:  # else its consumer reads the final event
            self._abandoned[handle.request_id] = handle
            self._ensure_running()
        return cancelled

    def cancel_all(self) -> int:
        """Cancel every live request (the drain deadline); returns how many."""
        handles = [h for h, _ in self._live.values()]
        return sum(h.cancel() for h in handles)

    def _ensure_running(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while self._live or self._abandoned:
            for handle, wake in list(self._live.values()):
                if handle.ready:
                    wake.set()
            for rid, handle in list(self._abandoned.items()):
                while (event := handle.poll()) is not None:
                    if event.finish_reason is not None:
                        del self._abandoned[rid]
                        break
            await asyncio.sleep(self.interval_s)


async def wait_disconnect(receive: Receive) -> None:
    """Return when the client has gone (call only once the request body has been read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


@contextlib.asynccontextmanager
async def cancel_on_disconnect(receive: Receive, on_disconnect: Callable[[], object]):
    """While the body runs, a client disconnect calls ``on_disconnect`` at once."""
    def gone(task: asyncio.Task) -> None:
        if not task.cancelled():
            task.exception()  # retrieved: a receive that failed is a client gone too
            on_disconnect()

    watcher = asyncio.get_running_loop().create_task(wait_disconnect(receive))
    watcher.add_done_callback(gone)
    try:
        yield watcher
    finally:
        watcher.cancel()


class EventStreamResponse(Response):
    """A ``text/event-stream`` response that cancels its request when the client leaves.

    Starlette's StreamingResponse notices a disconnect only when a write fails under
    newer ASGI servers, i.e. not before the first token; this one listens from the start.
    """

    media_type = "text/event-stream"

    def __init__(self, chunks: AsyncIterator[bytes], *, on_disconnect: Callable[[], object],
                 headers: dict[str, str] | None = None):
        self.chunks = chunks
        self.on_disconnect = on_disconnect
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                           **(headers or {})})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with cancel_on_disconnect(receive, self.on_disconnect) as gone:
                await send({"type": "http.response.start", "status": self.status_code,
                            "headers": self.raw_headers})
                async for data in self.chunks:
                    if gone.done():
                        break
                    await send({"type": "http.response.body", "body": data, "more_body": True})
                if not gone.done():
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # the socket closed under a write: the same as a disconnect
            self.on_disconnect()
        finally:
            await self.chunks.aclose()  # type: ignore[attr-defined]
