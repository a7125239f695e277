"""The ``n`` answers of one completion request, streamed or whole, with their logprobs.

Sample 0 is submitted first and the others once its first token is out: by then its
prompt's K/V is in the pool and its full blocks are in the prefix cache, so the other
samples find them there and share them (copy-on-write), each computing only the prompt's
last partial block. The pool holds the prompt once, not ``n`` times. Each sample gets its
own seed (``seed + index``), so seeded answers differ and repeat. Events of all samples
are read as they come (a stream interleaves its choices by index); an error in one, the
end of the response or the client leaving cancels them all.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

from app.server import reasoning, tool_calls
from app.server.errors import APIError, shutting_down
from app.server.logprobs_out import LegacyLogprobs, TokenText, chat_content
from app.server.responses import Reply, sse
from engine.generation import GenerationEvent
from engine.request import RequestHandle

ANSWERED = ("stop", "length")


def unfinished(reason: str, error: str | None) -> APIError:
    """Why an answer did not complete, as the error a client should see."""
    if reason == "error":
        return APIError(500, f"generation failed: {error}", type="server_error")
    if reason == "timeout":
        return APIError(504, "the request timed out", type="server_error", code="timeout")
    return shutting_down()  # cancelled at the drain deadline, or engine shutdown


class Samples:
    """The handles of one request's ``n`` samples (``fork(i)`` submits sample ``i``)."""

    def __init__(self, pump, first: RequestHandle, fork: Callable[[int], RequestHandle],
                 n: int):
        self.pump, self.n, self._fork = pump, n, fork
        self.handles = [first]
        self.closed = False  # the client left: no sample is forked after that

    def cancel_all(self) -> bool:
        """Cancel every sample; True if one was still running."""
        self.closed = True
        return any([self.pump.abandon(h) for h in self.handles])

    async def events(self) -> AsyncIterator[tuple[int, GenerationEvent]]:
        """(sample index, event) of all samples, as they come, up to every final event."""
        queue: asyncio.Queue = asyncio.Queue()
        tasks: list[asyncio.Task] = []

        def start(i: int, handle: RequestHandle) -> None:
            tasks.append(asyncio.get_running_loop().create_task(
                _drain(self.pump, i, handle, queue)))

        start(0, self.handles[0])
        live, forked = 1, self.n == 1
        try:
            while live:
                i, event = await queue.get()
                if event is None:
                    live -= 1
                    continue
                if not forked and (event.token is not None or event.finish_reason in ANSWERED):
                    forked = True  # sample 0's prompt is in the pool: the others share it
                    for j in range(1, self.n if not self.closed else 1):
                        self.handles.append(self._fork(j))
                        start(j, self.handles[-1])
                        live += 1
                yield i, event
        finally:
            for t in tasks:
                t.cancel()
            for h in self.handles:  # a task cancelled before it ran never read its handle
                self.pump.abandon(h)


async def _drain(pump, i: int, handle: RequestHandle, queue: asyncio.Queue) -> None:
    try:
        async for event in pump.events(handle):
            queue.put_nowait((i, event))
    finally:
        queue.put_nowait((i, None))


class ChoiceStream:
    """One answer's stream chunks as its events come: reasoning apart, tool calls held
    until they parse, logprobs sent with the first chunk after their tokens."""

    def __init__(self, reply: Reply, index: int, include_usage: bool):
        self.reply, self.index, self.include_usage = reply, index, include_usage
        self.think = reasoning.ReasoningStream(reply.thinking) if reply.kind == "chat" else None
        self.held = tool_calls.ToolStream() if reply.tools else None
        self.answer: list[str] = []
        self.text_of: TokenText | None = reply.token_text
        self.legacy = LegacyLogprobs(self.text_of) if self.text_of and reply.kind == "text" \
            else None
        self.pending: list = []  # logprobs of tokens whose text has not gone out yet

    def _logprobs(self):
        if self.text_of is None:
            return None
        lps, self.pending = self.pending, []
        return self.legacy(lps) if self.legacy else {"content": chat_content(self.text_of, lps)}

    def _chunk(self, text: str | None = None, **kw) -> dict:
        return self.reply.chunk(text, index=self.index, include_usage=self.include_usage,
                                logprobs=self._logprobs(), **kw)

    def feed(self, event: GenerationEvent) -> list[dict]:
        out = []
        self.pending += event.logprobs or []
        text = event.text
        if self.think is not None:
            thought, text = self.think.feed(text)
            if event.finish_reason is not None:  # the end: what was held goes out too
                more_thought, more_text = self.think.flush()
                thought, text = thought + more_thought, text + more_text
            if thought:
                out.append(self._chunk(reasoning=thought))
        self.answer.append(text)
        text = self.held.feed(text) if self.held is not None else text
        if text:
            out.append(self._chunk(text))
        if event.finish_reason not in ANSWERED:
            return out
        finish = event.finish_reason
        if self.held is not None:
            _, calls = tool_calls.parse("".join(self.answer), self.reply.tools)
            if calls:
                out.append(self.reply.calls_chunk(calls, self.include_usage, self.index))
                finish = "tool_calls"
            elif self.held.held:
                out.append(self._chunk(self.held.held))
        out.append(self._chunk(None if self.reply.kind == "chat" else "", finish=finish))
        return out


async def stream(samples: Samples, reply: Reply, include_usage: bool) -> AsyncIterator[bytes]:
    """The SSE chunks of the answers, ``data: [DONE]`` last."""
    n = samples.n
    if reply.kind == "chat":  # as OpenAI: the role first, before any text
        for i in range(n):
            yield sse(reply.chunk("", role=True, include_usage=include_usage, index=i))
    choices = [ChoiceStream(reply, i, include_usage) for i in range(n)]
    stats = [None] * n
    try:
        async with contextlib.aclosing(samples.events()) as events:
            async for i, event in events:
                for chunk in choices[i].feed(event):
                    yield sse(chunk)
                if event.finish_reason is None:
                    continue
                if event.finish_reason not in ANSWERED:
                    yield sse(unfinished(event.finish_reason, event.error).body())
                    return
                stats[i] = event.stats
    except APIError as e:
        yield sse(e.body())
        return
    if include_usage:
        yield sse(reply.usage_chunk(stats if n > 1 else stats[0]))
    yield sse("[DONE]")


async def whole(samples: Samples, reply: Reply) -> dict:
    """The answers read to their ends, as one response body; raises `APIError` for an
    answer that did not complete."""
    n = samples.n
    texts: list[list[str]] = [[] for _ in range(n)]
    lps: list[list] = [[] for _ in range(n)]
    finals: list[GenerationEvent | None] = [None] * n
    async with contextlib.aclosing(samples.events()) as events:
        async for i, event in events:
            texts[i].append(event.text)
            lps[i] += event.logprobs or []
            if event.finish_reason is not None:
                finals[i] = event
                if event.finish_reason not in ANSWERED:
                    raise unfinished(event.finish_reason, event.error)
    if any(f is None for f in finals):
        raise unfinished("cancelled", None)
    choices = []
    for i, (text, final) in enumerate(zip(texts, finals, strict=True)):
        logprobs = None
        if reply.token_text is not None:
            logprobs = (LegacyLogprobs(reply.token_text)(lps[i]) if reply.kind == "text"
                        else {"content": chat_content(reply.token_text, lps[i])})
        choices.append(reply.whole_choice("".join(text), final.finish_reason, index=i,
                                          logprobs=logprobs))
    stats = [f.stats for f in finals]
    return reply.completion_of(choices, stats if n > 1 else stats[0])
