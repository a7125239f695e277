"""Engine metrics: the seed's CacheMetrics plus scheduler counters and latency percentiles.

Prefill and decode are kept apart (time to first token, prefill tok/s,
inter-token latency, decode tok/s), each summarised as P50/P95/P99 over a
bounded window of recent samples, never as one average. A snapshot is plain
data and cheap enough to poll several times a second.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import asdict, dataclass, field
from functools import partial

from engine.kvcache.window_blocks import pool_bytes

LATENCY_KEYS = ("ttft_s", "prefill_tps", "itl_s", "decode_tps", "release_ms",
                "cancel_release_ms")


@dataclass(frozen=True, slots=True)
class Percentiles:
    """P50/P95/P99 (nearest rank) of a sample window; zeros when empty."""

    p50: float = 0.0
    p95: float = 0.0
    p99: float = 0.0
    count: int = 0

    @classmethod
    def of(cls, samples) -> Percentiles:
        xs = sorted(samples)
        if not xs:
            return cls()

        def rank(q: float) -> float:
            return xs[max(0, math.ceil(q * len(xs)) - 1)]

        return cls(rank(0.50), rank(0.95), rank(0.99), len(xs))


@dataclass(slots=True)
class ForwardClock:
    """Time spent in one kind of forward (prefill chunks, batched decodes, or mixed steps
    packing both), summed."""

    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass(slots=True)
class EngineMetrics:
    """One snapshot of the engine: pool, prefix cache, scheduler and latencies."""

    # the seed's CacheMetrics
    used_bytes: int = 0
    peak_bytes: int = 0
    hit_rate: float = 0.0  # prompt tokens served from the prefix cache / prompt tokens
    active_sequences: int = 0
    evictions: int = 0
    release_latency_ms: float = 0.0  # the last release (cancel/finish -> blocks back)
    # pool
    budget_bytes: int = 0
    bytes_per_block: int = 0
    bytes_per_token: int = 0
    kv_format: str = ""  # "float32", "float16", or e.g. "k=q8g64,v=q4g64"
    bytes_per_token_fp16: int = 0  # the same pool in float16: what a quantized format saves
    blocks_total: int = 0
    blocks_free: int = 0
    blocks_used: int = 0
    blocks_cached: int = 0
    blocks_shared: int = 0
    # prefix cache
    cached_tokens_total: int = 0
    prompt_tokens_total: int = 0
    disk_hits: int = 0
    disk_entries: int = 0
    disk_bytes: int = 0
    disk_write_errors: int = 0  # writes that failed (full or read-only disk, ...)
    disk_warning: str | None = None  # why the disk store runs degraded or off, once known
    disk_state: str = ""  # "on", "read-only" or "off" (`DiskPrefixStore.state`; off: none)
    # scheduler
    waiting: int = 0
    running: int = 0
    swapped: int = 0
    preemptions: int = 0
    rejections: int = 0
    interrupted_forwards: int = 0  # stopped between layer groups: all their requests cancelled
    rebuilt_steps: int = 0  # pipelined decode steps built again: a token they fed was unsure
    ahead_launched: int = 0  # a speculating engine's draft-free steps built before the read
    ahead_dropped: int = 0  # (`engine.ahead`): launched as built, or dropped (drafts came)
    spec_proposed: int = 0  # draft tokens verified (speculative decoding)
    spec_accepted: int = 0  # of which accepted
    finished: dict[str, int] = field(default_factory=dict)  # by finish reason
    steps: int = 0
    prefill_forward: ForwardClock = field(default_factory=ForwardClock)
    decode_forward: ForwardClock = field(default_factory=ForwardClock)
    mixed_forward: ForwardClock = field(default_factory=ForwardClock)  # tokens: all packed
    latency: dict[str, Percentiles] = field(default_factory=dict)
    kernel_fallback: str | None = None  # why the decode kernels were dropped, once they are

    def to_dict(self) -> dict:
        return asdict(self)


class MetricsRecorder:
    """Counters and latency windows the engine updates as it runs (thread-safe).

    Plain counter attributes (``steps``, ``preemptions``...) have one writer, the
    thread running the step, and a reader sees each int whole. Anything another thread
    updates (``rejections``, counted in callers' threads by `submit`) or that is read as
    a group (windows, forward clocks, finish reasons) changes only through a method here,
    under the lock.
    """

    def __init__(self, window: int = 2048):
        self._lock = threading.Lock()
        self._windows = {k: deque(maxlen=window) for k in LATENCY_KEYS}
        self.peak_blocks = 0
        self.preemptions = 0
        self.rejections = 0
        self.interrupted_forwards = self.rebuilt_steps = 0
        self.ahead_launched = self.ahead_dropped = 0
        self.spec_proposed = self.spec_accepted = 0
        self.cached_tokens = 0
        self.prompt_tokens = 0
        self.release_latency_ms = 0.0
        self.steps = 0
        self.finished: dict[str, int] = {}
        self.forwards = {"prefill": ForwardClock(), "decode": ForwardClock(),
                         "mixed": ForwardClock()}

    def time_forward(self, kind: str, tokens: int, seconds: float) -> None:
        """Add one forward of ``kind`` ("prefill", "decode" or "mixed") over ``tokens`` tokens."""
        with self._lock:
            clock = self.forwards[kind]
            clock.steps, clock.tokens = clock.steps + 1, clock.tokens + tokens
            clock.seconds += seconds

    def forward_clocks(self) -> dict[str, ForwardClock]:
        with self._lock:
            return {k: ForwardClock(c.steps, c.tokens, c.seconds) for k, c in self.forwards.items()}

    def observe(self, key: str, value: float) -> None:
        with self._lock:
            self._windows[key].append(value)

    def count_rejection(self) -> None:
        """One refused request; called from any caller's thread."""
        with self._lock:
            self.rejections += 1

    def finish(self, reason: str, release_ms: float) -> None:
        """One request ended for ``reason``; its blocks came back ``release_ms`` after the
        end was decided. One lock, so a reader never sees the count without the latency."""
        with self._lock:
            self.finished[reason] = self.finished.get(reason, 0) + 1
            self.release_latency_ms = release_ms
            self._windows["release_ms"].append(release_ms)
            if reason == "cancelled":
                self._windows["cancel_release_ms"].append(release_ms)

    def percentiles(self) -> dict[str, Percentiles]:
        with self._lock:
            windows = {k: list(w) for k, w in self._windows.items()}
        return {k: Percentiles.of(v) for k, v in windows.items()}


def snapshot(blocks, recorder: MetricsRecorder, layout, scheduler, prefix,
             inbox: int = 0) -> EngineMetrics:
    """The engine's metrics now: cheap (no MLX work), safe from any thread."""
    b, rec, bpb = blocks, recorder, layout.bytes_per_block
    w = b.window  # sliding-window layers' own store: their bytes follow its blocks
    nbytes = partial(pool_bytes, bpb, layout.num_layers, w.layers if w else 0)

    return EngineMetrics(
        used_bytes=nbytes(b.num_used_blocks, w.num_used if w else 0),
        # each store's own peak (an upper bound when they peaked at different times)
        peak_bytes=nbytes(rec.peak_blocks, w.peak_used if w else 0),
        hit_rate=rec.cached_tokens / rec.prompt_tokens if rec.prompt_tokens else 0.0,
        active_sequences=len(b.block_tables),
        evictions=b.evictions,
        release_latency_ms=rec.release_latency_ms,
        budget_bytes=nbytes(b.num_blocks, w.num_window_blocks - 1 if w else 0),
        bytes_per_block=bpb,
        bytes_per_token=layout.bytes_per_token,
        kv_format=layout.kv_format,
        bytes_per_token_fp16=layout.num_layers * 2 * layout.num_kv_heads * layout.head_dim * 2,
        blocks_total=b.num_blocks,
        blocks_free=b.num_free_blocks,
        blocks_used=b.num_used_blocks,
        blocks_cached=b.num_cached_blocks,
        blocks_shared=b.num_shared_blocks,
        cached_tokens_total=rec.cached_tokens,
        prompt_tokens_total=rec.prompt_tokens,
        disk_hits=prefix.disk_hits,
        **_disk_metrics(prefix.store),
        waiting=len(scheduler.waiting) + inbox,
        running=len(scheduler.running),
        swapped=len(scheduler.swapped),
        preemptions=rec.preemptions,
        rejections=rec.rejections,
        interrupted_forwards=rec.interrupted_forwards, rebuilt_steps=rec.rebuilt_steps,
        ahead_launched=rec.ahead_launched, ahead_dropped=rec.ahead_dropped,
        spec_proposed=rec.spec_proposed, spec_accepted=rec.spec_accepted,
        finished=dict(rec.finished),
        steps=rec.steps,
        **{f"{k}_forward": c for k, c in rec.forward_clocks().items()},
        latency=rec.percentiles(),
        kernel_fallback=_kernel_fallback(),
    )


def _kernel_fallback() -> str | None:
    from engine.model.attention.guard import kernel_fallback  # MLX-side: only when asked

    return kernel_fallback()


def _disk_metrics(store) -> dict:
    if store is None:
        return {"disk_state": "off"}
    st = store.stats()
    return {"disk_entries": st.entries, "disk_bytes": st.bytes,
            "disk_write_errors": st.write_errors, "disk_warning": store.degraded,
            "disk_state": store.state}
