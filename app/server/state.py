"""What the server's routes share: the engine, the keys, the event pump, limits, counters."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from app.server.keys import KeyStore
from app.server.streaming import EventPump

if TYPE_CHECKING:
    from engine import Engine


@dataclass(slots=True)
class ServerCounters:
    """Server-side figures the engine cannot know (exported on /metrics)."""

    responses: Counter = field(default_factory=Counter)  # (route, status) -> count
    disconnects: int = 0  # requests cancelled because their client went away
    drain_cancels: int = 0  # requests cancelled at the drain deadline of a SIGTERM


@dataclass(eq=False)
class ServerState:
    """The one engine and everything the routes need around it."""

    engine: Engine
    keys: KeyStore
    model_id: str
    max_waiting: int = 64
    """Requests queued for admission beyond which new ones get a 429."""
    max_n: int = 8
    """Answers one completion request may ask for (``n``); more is a 400."""
    default_max_tokens: int = 512
    """max_tokens of a request that sets none (then bounded by the context and the pool)."""
    drain_timeout_s: float = 30.0
    """After SIGTERM, in-flight requests may finish for this long; the rest are cancelled."""
    read_timeout_s: float = 30.0
    """A request's body must arrive whole within this (its headers too: `connections`)."""
    context_policy: str = "error"
    """Over the budget: summarize, truncate or error (`app.server.context`)."""
    context_budget: int | None = None
    """Prompt tokens a chat request may take; None: the context less its max_tokens."""
    pump: EventPump = field(default_factory=EventPump)
    counters: ServerCounters = field(default_factory=ServerCounters)
    draining: bool = False
    started_at: float = field(default_factory=time.time)
    # one thread: the tokenizer is used from one thread at a time (HF fast tokenizers
    # may refuse concurrent calls), and encoding must not run on the event loop
    tokenizer_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="kvchat-tokenize"))

    @property
    def fingerprint(self) -> str:
        return "kvchat-" + self.engine.loaded.fingerprint[:12]

    async def run_tokenizer(self, fn, *args, **kwargs):
        """Run a tokenizer call on the tokenizer thread, off the event loop."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.tokenizer_pool, lambda: fn(*args, **kwargs))

    def begin_drain(self) -> None:
        """SIGTERM: refuse new requests; cancel what is still running at the deadline."""
        if self.draining:
            return
        self.draining = True
        asyncio.get_running_loop().call_later(self.drain_timeout_s, self._drain_deadline)

    def _drain_deadline(self) -> None:
        self.counters.drain_cancels += self.pump.cancel_all()
