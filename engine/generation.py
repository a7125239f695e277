"""What a generation streams out: events, per-request stats, and the collected result."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field


@dataclass(slots=True)
class RequestStats:
    """Timings and KV usage of one request. Prefill and decode are kept apart."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    ttft_s: float = 0.0  # submit -> first token sampled (includes queueing and prefill)
    prefill_s: float = 0.0
    decode_s: float = 0.0  # first token -> last token
    queue_s: float = 0.0  # submit -> first admitted (waiting for blocks or a slot)
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    cache_source: str = "none"  # "none", "memory" or "disk"
    preemptions: int = 0
    release_latency_ms: float = 0.0  # finish/cancel decided -> blocks back in the pool
    block_size: int = 0
    blocks_used: int = 0  # blocks the sequence held at its largest
    bytes_per_token: int = 0
    kv_format: str = ""  # the pool's K/V format, e.g. "float32" or "k=q8g64,v=q4g64"
    bytes_used: int = 0  # blocks_used x bytes per block
    blocks_released: int = 0
    spec_proposed: int = 0  # draft tokens verified (speculative decoding)
    spec_accepted: int = 0  # of which accepted
    context_shifts: int = 0  # times the context was shifted (`engine.shifting`)
    shifted_tokens: int = 0  # tokens those shifts dropped from the cache
    stop_string: str | None = None  # the stop string that ended the answer, if one did
    inter_token_s: list[float] = field(default_factory=list)

    @property
    def prefill_tps(self) -> float:
        busy = self.ttft_s - self.queue_s
        return (self.prompt_tokens - self.cached_tokens) / busy if busy > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        n = self.generation_tokens - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0

    def kv_dict(self) -> dict:
        return {
            "block_size": self.block_size,
            "blocks_used": self.blocks_used,
            "bytes_per_token": self.bytes_per_token,
            "bytes_used": self.bytes_used,
            "format": self.kv_format,
            "blocks_released": self.blocks_released,
        }

    def to_dict(self) -> dict:
        d = asdict(self)
        del d["inter_token_s"]
        d.update(prefill_tps=self.prefill_tps, decode_tps=self.decode_tps)
        return d


@dataclass(slots=True)
class GenerationEvent:
    """One streamed step: the new token and text, and on the last event the finish."""

    request_id: int
    token: int | None  # None on a final event that carries no new token
    text: str  # text delta (may be empty while the detokenizer or a stop string holds it)
    finish_reason: str | None = None  # stop, length, cancelled, timeout, error, shutdown
    stats: RequestStats | None = None  # set on the final event
    error: str | None = None
    prefill: tuple[int, int] | None = None  # (done, total) prompt tokens, on progress events
    logprobs: list | None = None  # `engine.logprobs.TokenLogprob`s of ``token``, if asked


@dataclass(slots=True)
class GenerationResult:
    """A finished request: all its text and tokens, how it ended, its stats."""

    text: str
    tokens: list[int]
    finish_reason: str
    stats: RequestStats
    error: str | None = None
    logprobs: list = field(default_factory=list)  # one per token, when the request asked


def collect(events: Iterable[GenerationEvent]) -> GenerationResult:
    """Fold a request's event stream into one result (the last event carries the finish)."""
    text: list[str] = []
    tokens: list[int] = []
    logprobs: list = []
    final = None
    for event in events:
        text.append(event.text)
        if event.token is not None:
            tokens.append(event.token)
        logprobs += event.logprobs or []
        final = event
    if final is None or final.finish_reason is None:
        raise RuntimeError("the event stream ended without a final event")
    return GenerationResult("".join(text), tokens, final.finish_reason, final.stats,
                            final.error, logprobs)
