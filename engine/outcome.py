"""What a step's execution hands the engine: one `Outcome` per request, and a launched
decode step (`Flight`) whose tokens are read a step later."""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

from engine.request import Request


@dataclass(slots=True)
class Flight:
    """A greedy decode step launched (`mx.async_eval`) whose tokens are not read yet."""

    requests: list[Request]
    tokens: mx.array  # (B,) lazy: mlx-lm's argmax, or the extension's pick (-1: unsure)
    started: float
    logits: mx.array | None = None  # for the rows the pick declined


@dataclass(slots=True)
class Outcome:
    """What a step did for one request: K/V computed, a token sampled, or an error."""

    request: Request
    computed: int = 0  # tokens whose K/V this step wrote
    token: int | None = None  # the sampled next token (decode steps)
    error: str | None = None
    more: list[int] = field(default_factory=list)  # accepted tokens after ``token``
    drafted: int = 0  # draft tokens verified: ``drafted - len(more)`` slots go back
    logprobs: list | None = None  # `TokenLogprob`s of [token, *more], if the request asked


def error_text(e: Exception) -> str:
    return f"{type(e).__name__}: {e}"


def same_requests(a: list[Request], b: list[Request]) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))
