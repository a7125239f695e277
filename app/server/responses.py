"""Response bodies of the OpenAI API: completions, stream chunks, usage, SSE framing.

Every response also carries a ``kvchat`` object (extra fields are allowed by OpenAI's
clients): the max_tokens the request was granted and, when the engine reduced it to fit
the context or the KV pool, the notice saying so (also sent as the ``X-Kvchat-Notice``
header, before the first byte of a stream), plus the prefix-cache figures of the request.
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field

from engine.generation import RequestStats

OBJECTS = {"chat": ("chat.completion", "chat.completion.chunk", "chatcmpl-"),
           "text": ("text_completion", "text_completion", "cmpl-")}


def usage(stats: RequestStats | list[RequestStats]) -> dict:
    """OpenAI's usage object, with the prompt tokens the prefix cache served; for ``n``
    answers (a list, the first one's prompt) the prompt counts once, completions add up."""
    runs = stats if isinstance(stats, list) else [stats]
    prompt, completion = runs[0].prompt_tokens, sum(s.generation_tokens for s in runs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": runs[0].cached_tokens},
    }


def sse(data: dict | str) -> bytes:
    """One server-sent event (``data: ...`` and a blank line)."""
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


@dataclass(slots=True)
class Reply:
    """One answer: the id, time and model every chunk of it repeats, and its kvchat extras."""

    kind: str  # "chat" or "text"
    model: str
    fingerprint: str
    max_tokens: int  # what the engine granted
    notice: str | None = None  # e.g. "max_tokens reduced from 4096 to 812 to fit"
    tools: list = field(default_factory=list)  # `tool_calls.Tool`s the answer may call
    thinking: bool = False  # the answer starts inside a think tag the template opened
    context: dict | None = None  # what the context policy cut or summarized
    token_text: object = None  # `logprobs_out.TokenText` when the request asks for logprobs
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self):
        self.id = self.id or OBJECTS[self.kind][2] + secrets.token_hex(12)

    def extras(self, stats: RequestStats | list[RequestStats] | None = None) -> dict:
        out = {"max_tokens": self.max_tokens, "notice": self.notice}
        if isinstance(stats, list):  # n answers: the first one's figures, and each's cache
            out["samples_cached_tokens"] = [s.cached_tokens for s in stats]
            stats = stats[0]
        if self.context is not None:
            out.update(truncated_turns=self.context["truncated_turns"],
                       summarized_turns=self.context["summarized_turns"], context=self.context)
        if stats is not None:
            out.update(cached_tokens=stats.cached_tokens, cache_source=stats.cache_source,
                       blocks_used=stats.blocks_used, queue_s=round(stats.queue_s, 6),
                       ttft_s=round(stats.ttft_s, 6), preemptions=stats.preemptions,
                       spec_proposed=stats.spec_proposed, spec_accepted=stats.spec_accepted,
                       context_shifts=stats.context_shifts, shifted_tokens=stats.shifted_tokens)
        return out

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint}

    def _choice(self, text: str | None, finish: str | None, *, role: bool = False,
                whole: bool = False, calls: list | None = None,
                reasoning: str | None = None, index: int = 0, logprobs=None) -> dict:
        if self.kind == "text":
            return {"index": index, "text": text or "", "logprobs": logprobs,
                    "finish_reason": finish}
        if whole:
            message = {"role": "assistant", "content": text}
            if reasoning is not None:
                message["reasoning_content"] = reasoning
            if calls:
                message.update(content=text or None,
                               tool_calls=[c.to_dict() for c in calls])
            return {"index": index, "message": message, "logprobs": logprobs,
                    "finish_reason": finish}
        delta = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        if reasoning is not None:
            delta["reasoning_content"] = reasoning
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

    def chunk(self, text: str | None = None, *, finish: str | None = None, role: bool = False,
              include_usage: bool = False, reasoning: str | None = None, index: int = 0,
              logprobs=None) -> dict:
        """A stream chunk: the first (``role``), a text or reasoning delta, or the one with
        the finish; of answer ``index``, with the ``logprobs`` of its tokens."""
        out = self._head(OBJECTS[self.kind][1])
        out["choices"] = [self._choice(text, finish, role=role, reasoning=reasoning,
                                       index=index, logprobs=logprobs)]
        if include_usage:
            out["usage"] = None  # as OpenAI: null on every chunk but the usage one
        return out

    def calls_chunk(self, calls: list, include_usage: bool = False, index: int = 0) -> dict:
        """A stream chunk carrying whole tool calls (``delta.tool_calls``)."""
        out = self.chunk(include_usage=include_usage, index=index)
        out["choices"][0]["delta"]["tool_calls"] = [c.to_dict(i) for i, c in enumerate(calls)]
        return out

    def usage_chunk(self, stats: RequestStats | list[RequestStats]) -> dict:
        """The last chunk of a stream with ``include_usage``: no choices, the usage."""
        out = self._head(OBJECTS[self.kind][1])
        out.update(choices=[], usage=usage(stats), kvchat=self.extras(stats))
        return out

    def completion(self, text: str, finish: str, stats: RequestStats) -> dict:
        """A whole (non-streamed) answer."""
        return self.completion_of([self.whole_choice(text, finish)], stats)

    def completion_of(self, choices: list[dict], stats: RequestStats | list[RequestStats]
                      ) -> dict:
        """A whole response of ``whole_choice``s (and each answer's stats, for ``n``)."""
        out = self._head(OBJECTS[self.kind][0])
        out.update(choices=choices, usage=usage(stats), kvchat=self.extras(stats))
        return out

    def whole_choice(self, text: str, finish: str, *, index: int = 0, logprobs=None) -> dict:
        """One whole answer: its reasoning and tool calls apart."""
        calls, thought = None, None
        if self.kind == "chat":
            from app.server.reasoning import split

            thought, text = split(text, self.thinking)
        if self.tools:
            from app.server.tool_calls import parse

            content, calls = parse(text, self.tools)
            if calls:
                text, finish = content, "tool_calls"
        return self._choice(text, finish, whole=True, calls=calls, reasoning=thought,
                            index=index, logprobs=logprobs)

    def headers(self) -> dict[str, str]:
        """Sent before the body: the granted max_tokens and, if reduced, why."""
        out = {"X-Kvchat-Max-Tokens": str(self.max_tokens)}
        if self.notice:  # a header is latin-1: "turns 1–6 summarized (a → b)" in ASCII
            ascii_notice = self.notice.replace("–", "-").replace("→", "->")
            out["X-Kvchat-Notice"] = ascii_notice.encode("ascii", "replace").decode()
        return out
