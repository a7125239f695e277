"""`EngineLike`: the part of `engine.Engine` the TUI and the CLI use, as a typed Protocol.

Front ends type against this, not the concrete class, so a scripted engine (the TUI
tests' `FakeEngine`) can stand in for it; tests check that both the real `Engine` and
the fake implement every member with these parameter names.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from engine import Priority, SamplingParams
    from engine.generation import GenerationEvent
    from engine.metrics import EngineMetrics


@runtime_checkable
class HandleLike(Protocol):
    """A submitted request: iterate it for events; the last one has a finish reason."""

    request_id: int
    max_tokens: int  # new tokens granted: the params' max_tokens, or fewer to fit
    notice: str | None  # e.g. "max_tokens reduced ... to fit", set at submit

    def __iter__(self) -> Iterator[GenerationEvent]: ...

    def cancel(self) -> bool:
        """Cancel this request (it ends within one engine step)."""
        ...


@runtime_checkable
class EngineLike(Protocol):
    """What kvchat's front ends call on an engine."""

    loaded: Any  # the LoadedModel: name, path, weight_format, fingerprints
    max_context: int  # tokens one sequence may hold (prompt + output)
    notices: list[str]  # what the engine changed from its config (a KV format that fell back)

    def start(self) -> None:
        """Run steps on a background thread (idempotent)."""
        ...

    def shutdown(self) -> None:
        """Cancel every request, give the pool back and stop."""
        ...

    def encode_prompt(self, prompt: str, *, system: str | None = None, raw: bool = False,
                      history: list[dict] | None = None) -> list[int]:
        """Token ids of a user prompt (through the chat template unless ``raw``)."""
        ...

    def encode_pinned(self, document: str, question: str, *, system: str,
                      history: list[dict] | None = None) -> tuple[list[int], int]:
        """(ids, prefix_len) with ``document`` first: ``ids[:prefix_len]`` is the same for
        every question and history about it, so its KV blocks are reused."""
        ...

    def count_tokens(self, text: str) -> int:
        """Tokens ``text`` takes alone (no chat template, no special tokens)."""
        ...

    def submit(self, prompt_ids: list[int], params: SamplingParams | None = None, *,
               priority: Priority = ..., timeout_s: float | None = None,
               tenant: str = "local", permission_version: int = 0,
               cache_ttl_s: float | None = None) -> HandleLike:
        """Queue a request; raises RequestError at once if it is refused (a
        RequestTooLargeError if it can never fit; one that fits only with fewer new
        tokens gets them, on the handle's ``max_tokens`` and ``notice``).

        ``cache_ttl_s``: how long the prompt's blocks stay in the disk cache (a pinned
        document's prefix); None keeps the tenant's TTL.
        """
        ...

    def generate(self, prompt_ids: list[int], params: SamplingParams | None = None,
                 **kwargs: Any) -> Iterator[GenerationEvent]:
        """Submit and stream one request's events (``kwargs`` as for `submit`)."""
        ...

    def cancel(self, request_id: int) -> bool:
        """Cancel a request by id; False if unknown or already finished."""
        ...

    def metrics(self) -> EngineMetrics:
        """A snapshot of the pool, prefix cache, scheduler and latencies."""
        ...

    def block_map(self) -> str:
        """One character per KV block: "." free, "#" used, "S" shared, "c" cached."""
        ...
