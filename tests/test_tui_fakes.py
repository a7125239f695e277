"""A scripted engine for TUI tests, and tests of the turn logic that drives it.

`FakeEngine` speaks the engine's API (encode_prompt, encode_pinned, count_tokens, start,
submit -> iterable handle, cancel, metrics, block_map, shutdown) with fixed events and
fixed metrics, so UI tests and snapshots are fast and deterministic. Its metrics follow
the KV cache format it is built in (the settings' names), so the cache panel's quantized
view is covered too.
The real engine is used in test_tui.py.
"""

from __future__ import annotations

import dataclasses
import inspect
import threading
import time
from types import SimpleNamespace

import pytest

from app.engine_like import EngineLike, HandleLike
from app.settings import KV_CACHE_FORMATS
from app.tui.generation import (
    PrefillProgress,
    TextReceived,
    Turn,
    TurnFinished,
    TurnRejected,
    TurnStarted,
    stats_line,
    stream_turn,
)
from engine import Engine, Priority, SamplingParams
from engine.errors import RequestError, RequestTooLargeError
from engine.generation import GenerationEvent
from engine.metrics import EngineMetrics, Percentiles

# SmolLM2-135M's pool on a CPU: 30 layers x 3 KV heads x head dim 64, float32, 16-token blocks
LAYERS_X_HEADS, HEAD_DIM = 30 * 3, 64
FIXED_METRICS = EngineMetrics(
    used_bytes=6 * 737_280, peak_bytes=9 * 737_280, hit_rate=0.42, active_sequences=1,
    evictions=3, release_latency_ms=0.37, budget_bytes=96 * 737_280, bytes_per_block=737_280,
    bytes_per_token=46_080, kv_format="float32", bytes_per_token_fp16=23_040,
    blocks_total=96, blocks_free=84, blocks_used=6, blocks_cached=6, blocks_shared=2,
    cached_tokens_total=320, prompt_tokens_total=760, waiting=0, running=1, preemptions=1,
    rejections=2,
    latency={"ttft_s": Percentiles(0.21, 0.48, 0.5, 12),
             "itl_s": Percentiles(0.055, 0.07, 0.09, 300)},
)
FIXED_BLOCK_MAP = "SS####cccccc" + "." * 84


def fake_metrics(kv_cache: str | None = None) -> EngineMetrics:
    """FIXED_METRICS for a pool in ``kv_cache`` (a settings name): same blocks, its bytes.

    A quantized row is its packed elements plus a float16 scale and bias per group of 64,
    as the engine counts it; an unquantized side stays float32.
    """
    k, v = KV_CACHE_FORMATS.get(kv_cache or "float", (None, None))
    if k is None and v is None:
        return FIXED_METRICS
    rows = [HEAD_DIM * b // 8 + 2 * 2 if b else 4 * HEAD_DIM for b in (k, v)]
    names = [f"q{b}g64" if b else "float32" for b in (k, v)]
    per_token = LAYERS_X_HEADS * sum(rows)
    block = 16 * per_token
    return dataclasses.replace(
        FIXED_METRICS, kv_format=f"k={names[0]},v={names[1]}", bytes_per_token=per_token,
        bytes_per_block=block, used_bytes=6 * block, peak_bytes=9 * block,
        budget_bytes=96 * block)


def long_reply(words: int = 400) -> str:
    """A long answer that never repeats itself (the chat stops one that loops)."""
    return " ".join(f"w{i}" for i in range(words))


def fixed_stats(prompt_tokens: int, generated: int, released: int = 4):
    cached = min(16, prompt_tokens)
    return SimpleNamespace(prompt_tokens=prompt_tokens, generation_tokens=generated,
                           ttft_s=0.25, prefill_tps=480.0, decode_tps=18.5,
                           cached_tokens=cached, cache_source="memory" if cached else "none",
                           blocks_used=released, blocks_released=released)


class FakeHandle:
    """What `FakeEngine.submit` returns: an iterable of events with a request id."""

    def __init__(self, request_id, events, engine, max_tokens):
        self.request_id, self.notice, self._events = request_id, None, events
        self.max_tokens = max_tokens
        self._engine = engine

    def __iter__(self):
        return iter(self._events)

    def cancel(self):
        return self._engine.cancel(self.request_id)


class FakeEngine:
    """Streams ``reply`` word by word (``delay`` s apart); cancel ends it at the next event.

    Implements `app.engine_like.EngineLike` (checked below against the real `Engine`).
    """

    def __init__(self, reply: str = "The capital of France is **Paris**.", *, delay: float = 0.0,
                 max_prompt_tokens: int = 4096, prefill_events: int = 0,
                 kv_cache: str | None = None):
        self.reply, self.delay = reply, delay
        self.kv_cache = kv_cache  # the KV format it was built in: its metrics show it
        self.max_prompt_tokens = max_prompt_tokens
        self.prefill_events = prefill_events
        self.loaded = SimpleNamespace(weight_format="fake", name="fake")
        self.max_context = max_prompt_tokens
        self.notices: list[str] = []
        self.started = self.stopped = False
        self.cancelled: set[int] = set()
        self.submitted: list[list[int]] = []
        self.submit_kwargs: list[dict] = []  # priority, cache_ttl_s... of each submit
        self.pinned: list[tuple[str, str, str]] = []  # (document, question, system)
        self.histories: list[list[dict]] = []
        self._next_id = 0
        self._lock = threading.Lock()

    def encode_prompt(self, prompt, *, system=None, raw=False, history=None):
        if not prompt or not prompt.strip():
            raise RequestError("the prompt is empty")
        self.histories.append(list(history or []))
        words = sum(len(m["content"].split()) for m in history or []) + len(prompt.split())
        return list(range(words + (len(system.split()) if system else 0)))

    def encode_pinned(self, document, question, *, system, history=None):
        if not question or not question.strip():
            raise RequestError("the question is empty")
        self.pinned.append((document, question, system))
        self.histories.append(list(history or []))
        prefix = self.count_tokens(system) + self.count_tokens(document)
        rest = sum(self.count_tokens(m["content"]) for m in history or [])
        return list(range(prefix + rest + self.count_tokens(question))), prefix

    def count_tokens(self, text):
        return len(text.split())  # one token a word, as encode_prompt counts

    def start(self):
        self.started = True

    def shutdown(self):
        self.stopped = True

    def submit(self, prompt_ids, params=None, *, priority=Priority.INTERACTIVE, timeout_s=None,
               tenant="local", permission_version=0, cache_ttl_s=None):
        if len(prompt_ids) > self.max_prompt_tokens:
            raise RequestTooLargeError(f"the prompt has {len(prompt_ids)} tokens; "
                                       f"the context holds {self.max_prompt_tokens}")
        with self._lock:
            rid, self._next_id = self._next_id, self._next_id + 1
        self.submitted.append(prompt_ids)
        self.submit_kwargs.append({"priority": priority, "cache_ttl_s": cache_ttl_s})
        return FakeHandle(rid, self._events(rid, len(prompt_ids), params), self,
                          (params or SamplingParams()).max_tokens)

    def generate(self, prompt_ids, params=None, **kwargs):
        yield from self.submit(prompt_ids, params, **kwargs)

    def _events(self, rid, n, params):
        for i in range(self.prefill_events):
            yield GenerationEvent(rid, None, "", prefill=(i * n // self.prefill_events, n))
        words = self.reply.split(" ")
        limit = params.max_tokens if params else len(words)
        for i, word in enumerate(words[:limit]):
            if self.delay:
                time.sleep(self.delay)
            if rid in self.cancelled or self.stopped:  # shutdown ends every request
                yield GenerationEvent(rid, None, "",
                                      finish_reason="shutdown" if self.stopped else "cancelled",
                                      stats=fixed_stats(n, i))
                return
            yield GenerationEvent(rid, i, word if i == 0 else " " + word)
        reason = "length" if limit < len(words) else "stop"
        yield GenerationEvent(rid, None, "", finish_reason=reason,
                              stats=fixed_stats(n, min(limit, len(words))))

    def cancel(self, request_id):
        self.cancelled.add(request_id)
        return True

    def metrics(self):
        return fake_metrics(self.kv_cache)

    def block_map(self):
        return FIXED_BLOCK_MAP


def run_turn(engine, prompt, history=(), max_tokens=64, **turn_fields):
    posted = []
    turn = Turn(prompt, engine, "", list(history), **turn_fields)
    stream_turn(turn, SamplingParams(max_tokens=max_tokens), posted.append)
    return turn, posted


def test_stream_turn_posts_start_text_and_finish():
    engine = FakeEngine("one two three", prefill_events=2)
    turn, posted = run_turn(engine, "hello there")
    kinds = [type(m) for m in posted]
    assert kinds[0] is TurnStarted and kinds[-1] is TurnFinished
    assert PrefillProgress in kinds
    assert "".join(m.text for m in posted if isinstance(m, TextReceived)) == "one two three"
    assert posted[-1].finish_reason == "stop" and turn.request_id == 0


def test_stream_turn_batches_fast_deltas():
    engine = FakeEngine(long_reply(200))
    _, posted = run_turn(engine, "go", max_tokens=200)
    texts = [m for m in posted if isinstance(m, TextReceived)]
    assert len(texts) < 20  # 200 instant tokens arrive in a few batches, not 200 updates
    assert "".join(m.text for m in texts) == long_reply(200)


def test_stream_turn_rejects_what_can_never_fit():
    engine = FakeEngine(max_prompt_tokens=10)
    _, posted = run_turn(engine, "word " * 50)
    assert len(posted) == 1 and isinstance(posted[0], TurnRejected)
    assert "the context holds 10" in posted[0].error


def test_stream_turn_drops_oldest_history_to_fit():
    engine = FakeEngine(max_prompt_tokens=12)
    history = [{"role": "user", "content": "a " * 5}, {"role": "assistant", "content": "b " * 5},
               {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]
    # a budget the estimate says fits: the engine's refusal drops the oldest pair
    turn, posted = run_turn(engine, "short question", history, budget=1000)
    assert isinstance(posted[-1], TurnFinished)
    assert turn.dropped_turns == 1
    assert engine.histories[-1] == history[2:]
    assert "1 oldest turn(s) left out" in turn.fitted.notes()[0]


@pytest.mark.parametrize("policy", ["truncate", "summarize", "error"])
def test_stream_turn_keeps_to_its_budget_by_policy(policy):
    engine = FakeEngine(max_prompt_tokens=10_000)
    history = [{"role": r, "content": "w " * 10} for _ in range(4) for r in ("user", "assistant")]
    turn, posted = run_turn(engine, "short question", history, budget=40, policy=policy)
    if policy == "error":  # nothing is cut: the prompt is refused
        assert isinstance(posted[-1], TurnRejected) and "over its budget" in posted[-1].error
        assert not posted[-1].too_large  # not a paste to offer as a document
        return
    assert isinstance(posted[-1], TurnFinished)
    assert turn.dropped_turns == 3 and engine.histories[-1] == history[6:]


def test_cancel_before_the_request_id_is_known():
    engine = FakeEngine("a b c d")
    turn = Turn("hi", engine)
    turn.cancel_requested = True
    posted = []
    stream_turn(turn, SamplingParams(), posted.append)
    assert posted[-1].finish_reason == "cancelled"


@pytest.mark.parametrize(("reason", "expected"), [
    ("stop", "3 tokens · 18.5 tok/s · TTFT 0.25 s · prefill 480 tok/s · "
             "16/40 prompt tokens cached"),
    ("length", "max tokens reached"),
    ("cancelled", "cancelled — 4 blocks released"),
    ("shutdown", "the model was unloaded — 4 blocks released"),
])
def test_stats_line(reason, expected):
    assert expected in stats_line(reason, fixed_stats(40, 3))


def test_stats_line_error():
    assert stats_line("error", None, "boom") == "error: boom"


def _members(protocol) -> dict[str, inspect.Signature | None]:
    """The protocol's methods (with signatures) and attributes (None)."""
    names = {n for n in vars(protocol) if not n.startswith("_")} | set(
        getattr(protocol, "__annotations__", {}))
    return {n: inspect.signature(getattr(protocol, n)) if callable(getattr(protocol, n, None))
            else None for n in names}


@pytest.mark.parametrize("impl", [FakeEngine, Engine], ids=["fake", "engine"])
def test_engines_implement_engine_like(impl):
    """Every EngineLike method exists on both, taking at least the protocol's parameters."""
    for name, sig in _members(EngineLike).items():
        if sig is None:  # an attribute: set in __init__ (checked on the fake instance below)
            continue
        have = inspect.signature(getattr(impl, name)).parameters
        takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in have.values())
        missing = [p for p in sig.parameters if p not in have and not takes_kwargs]
        assert not missing, f"{impl.__name__}.{name} lacks {missing}"
    fake = FakeEngine()
    assert isinstance(fake, EngineLike)
    assert isinstance(fake.submit([1, 2], SamplingParams(max_tokens=1)), HandleLike)


def test_cache_panel_rows_show_the_budget_and_what_used_it():
    from app.tui.widgets.cache_panel import context_rows

    engine = FakeEngine(max_prompt_tokens=10_000)
    history = [{"role": r, "content": "w " * 10} for _ in range(4) for r in ("user", "assistant")]
    turn, _ = run_turn(engine, "short question", history, budget=40, policy="truncate")
    rows = dict(context_rows(turn.usage()))
    assert rows["budget"].endswith("/40 tok · truncate")
    text = " ".join(v for _, v in context_rows(turn.usage()))
    assert "history 28 · docs 0" in text and "summary 0" in text
    assert "3 oldest turn(s) left out" in text
    assert context_rows(None) == []
