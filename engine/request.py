"""A generation request as the scheduler sees it, and the handle its caller streams from."""

from __future__ import annotations

import enum
import queue
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from engine.decoder import Decoder
from engine.generation import GenerationEvent, RequestStats
from engine.kvcache.prefix_cache import SeqPrefix
from engine.kvcache.swap import SwappedKV


class Priority(enum.IntEnum):
    """Lower value = served first and preempted last."""

    INTERACTIVE = 0
    BACKGROUND = 1


class RequestState(enum.Enum):
    WAITING = "waiting"  # queued, holds no blocks
    RUNNING = "running"  # holds blocks; prefilling or decoding
    SWAPPED = "swapped"  # preempted, its K/V parked in host memory
    FINISHED = "finished"


class Joined(Sequence[int]):
    """Two token lists read as one (``head + tail``) without copying either: building the
    list copies a 2k-token context, ~40 us after a forward has left the caches cold."""

    __slots__ = ("head", "tail")

    def __init__(self, head: list[int], tail: list[int]):
        self.head, self.tail = head, tail

    def __len__(self) -> int:
        return len(self.head) + len(self.tail)

    def __getitem__(self, i):
        n, total = len(self.head), len(self)
        if isinstance(i, slice):
            start, stop, step = i.indices(total)
            if step != 1:
                return (self.head + self.tail)[i]
            if stop <= n:
                return self.head[start:stop]
            if start >= n:
                return self.tail[start - n:stop - n]
            return self.head[start:] + self.tail[:stop - n]
        if not -total <= i < total:
            raise IndexError("token index out of range")
        i %= total
        return self.head[i] if i < n else self.tail[i - n]


@dataclass(eq=False)
class Request:
    """One request's full state. Mutated only by the engine's step loop.

    ``request_id`` is also the id of its sequence in the block manager.
    """

    request_id: int
    prompt_ids: list[int]
    decoder: Decoder  # sampling, detokenizing, stop strings, max new tokens
    prefix: SeqPrefix  # its prefix-cache salt, block hashes and registered blocks
    priority: Priority = Priority.INTERACTIVE
    deadline: float | None = None  # time.perf_counter() value
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
    swap: SwappedKV | None = None  # host copy of the K/V while SWAPPED
    draft: list[int] = field(default_factory=list)  # tokens this step verifies (speculation)
    context_shift: bool = False  # past the context, drop the middle (`engine.shifting`)
    num_sinks: int = 0  # leading tokens a context shift keeps
    num_dropped: int = 0  # tokens after the sinks that shifts dropped from the cache
    events: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)

    @property
    def max_new(self) -> int:
        return self.decoder.max_new

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def ids_view(self) -> Joined:
        """``all_ids`` read in place: a per-step lookup reads only its last few tokens."""
        return Joined(self.prompt_ids, self.output_ids)

    @property
    def last_id(self) -> int:
        """``all_ids[-1]`` without building the list (a 2k-token context: ~50 us)."""
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def total_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def kv_ids(self) -> list[int]:
        """The tokens whose K/V the cache holds (or a recompute prefills), in cache order."""
        if not self.num_dropped:
            return self.all_ids
        ids = self.all_ids
        return ids[:self.num_sinks] + ids[self.num_sinks + self.num_dropped:]

    @property
    def kv_len(self) -> int:
        return self.total_len - self.num_dropped

    @property
    def in_prefill(self) -> bool:
        """True while K/V is missing for more than the one token the next decode step feeds."""
        return self.num_computed < self.kv_len - 1

    @property
    def finished(self) -> bool:
        return self.state is RequestState.FINISHED


class RequestHandle:
    """What `Engine.submit` returns: iterate it for the request's events.

    Iterating is safe from any thread. Leaving the loop early (break, an
    exception, the generator being closed or collected) or dropping the handle
    cancels the request, so a consumer that goes away never leaks blocks.
    Iterating a handle whose final event was already read ends at once.
    ``max_tokens`` is what the request was granted: its own, or fewer to fit the
    context or the pool (then ``notice`` says so).
    """

    def __init__(self, request_id: int, next_event: Callable[[], GenerationEvent],
                 ready: Callable[[], bool], cancel: Callable[[int], bool],
                 max_tokens: int, notice: str | None = None):
        self.request_id = request_id
        self.max_tokens = max_tokens
        self.notice = notice
        self._next_event = next_event
        self._ready = ready
        self._cancel = cancel
        self._done = False
        # a handle dropped without being read to the end is a consumer gone away
        weakref.finalize(self, cancel, request_id)

    @property
    def done(self) -> bool:
        """True once the final event has been read."""
        return self._done

    def cancel(self) -> bool:
        return self._cancel(self.request_id)

    @property
    def ready(self) -> bool:
        """Whether an event is waiting to be read (reading it will not block or step)."""
        return not self._done and self._ready()

    def poll(self) -> GenerationEvent | None:
        """The next event if one is ready, else None; never steps the engine or waits."""
        if not self.ready:
            return None
        event = self._next_event()
        self._done = event.finish_reason is not None
        return event

    def __iter__(self) -> Iterator[GenerationEvent]:
        try:
            while not self._done:
                event = self._next_event()
                self._done = event.finish_reason is not None
                yield event
        finally:
            if not self._done:
                self._cancel(self.request_id)
