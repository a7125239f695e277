"""A generation request as the scheduler sees it, and the handle its caller streams from."""

from __future__ import annotations

import enum
import queue
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.generation import GenerationEvent, RequestStats, StopMatcher
from engine.sampling import SamplingParams

if TYPE_CHECKING:
    from engine.engine import Engine


class Priority(enum.IntEnum):
    """Lower value = served first and preempted last."""

    INTERACTIVE = 0
    BACKGROUND = 1


class RequestState(enum.Enum):
    WAITING = "waiting"  # queued, holds no blocks
    RUNNING = "running"  # holds blocks; prefilling or decoding
    SWAPPED = "swapped"  # preempted, its K/V parked in host memory
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One request's full state. Mutated only by the engine's step loop."""

    request_id: int
    prompt_ids: list[int]
    params: SamplingParams
    max_new: int
    priority: Priority = Priority.INTERACTIVE
    deadline: float | None = None  # time.perf_counter() value
    tenant: str = "local"
    permission_version: int = 0
    arrival: float = field(default_factory=time.perf_counter)
    state: RequestState = RequestState.WAITING
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V is in the pool
    started: float = 0.0  # when last admitted (preemption picks the most recent)
    last_token_at: float = 0.0
    stats: RequestStats = field(default_factory=RequestStats)
    finish_reason: str | None = None
    error: str | None = None
    notice: str | None = None  # e.g. "max_tokens reduced from 512 to 100 to fit the pool"
    cancel_at: float | None = None  # perf_counter() of the cancel() call
    # per-request generation helpers, built on first admission
    sampler: Any = None
    processors: list = field(default_factory=list)
    detok: Any = None
    stop: StopMatcher | None = None
    swap: Any = None  # host copy of the K/V while SWAPPED
    salt: Any = None  # prefix-cache salt (model, tokenizer, ..., tenant, permission version)
    block_hashes: list[bytes] = field(default_factory=list)  # chained, per full block
    registered: int = 0  # leading blocks already named in the prefix cache
    pending: Any = None  # lazily computed next token (mx.array) not yet read back
    events: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def total_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def in_prefill(self) -> bool:
        """True while K/V is missing for more than the one token the next decode step feeds."""
        return self.num_computed < self.total_len - 1

    @property
    def finished(self) -> bool:
        return self.state is RequestState.FINISHED


class RequestHandle:
    """What `Engine.submit` returns: iterate it for the request's events.

    Iterating is safe from any thread. Leaving the loop early (break, an
    exception, the generator being closed or collected) or dropping the handle
    cancels the request, so a consumer that goes away never leaks blocks.
    """

    def __init__(self, engine: Engine, request: Request):
        self._engine = engine
        self._request = request
        self.request_id = request.request_id
        # a handle dropped without being read to the end is a consumer gone away
        weakref.finalize(self, engine.cancel, request.request_id)

    @property
    def notice(self) -> str | None:
        return self._request.notice

    def cancel(self) -> bool:
        return self._engine.cancel(self.request_id)

    def __iter__(self) -> Iterator[GenerationEvent]:
        done = False
        try:
            while not done:
                event = self._engine._next_event(self._request)
                done = event.finish_reason is not None
                yield event
        finally:
            if not done:
                self._engine.cancel(self.request_id)
