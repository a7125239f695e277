"""One chat turn on the engine, run in a thread worker; the UI hears of it only by messages.

`stream_turn` submits the prompt, reads the request's events (a blocking iterator) and
posts `TextReceived` in batches of about 20 a second, `PrefillProgress` while a long
prompt is prefilled, and one `TurnFinished` or `TurnRejected` at the end.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from textual.message import Message

from app.context_policy import ContextBudgetError, Fitted, Summary, default_chat_budget, fit
from app.context_summary import SummaryJob
from app.documents.qa import Prepared
from app.documents.sessions import DEFAULT_SESSION_TTL_S
from app.engine_like import EngineLike, HandleLike
from app.tui.documents import AttachedDocuments
from app.tui.repetition import loop_cut
from engine import SamplingParams
from engine.errors import KVChatError, RequestError, RequestTooLargeError
from engine.request import Priority

FLUSH_S = 0.05  # text deltas are batched to ~20 UI updates a second
PREFILL_REPORT_S = 0.1


@dataclass(eq=False)
class Turn:
    """A running turn: what was asked, and the request id once the engine took it."""

    prompt: str
    engine: EngineLike  # the engine the turn runs on (a model switch installs another)
    system: str = ""
    history: list[dict] = field(default_factory=list)
    request_id: int | None = None
    cancel_requested: bool = False
    documents: AttachedDocuments | None = None  # set: the question is about them
    prepared: Prepared | None = None  # the document prompt, once built
    policy: str = "summarize"  # the context policy (app.context_policy)
    budget: int | None = None  # prompt tokens; None: default_chat_budget of the context
    summary: Summary | None = None  # the conversation's summary, if any
    pending: SummaryJob | None = None  # a summary being written; waited for if needed
    fitted: Fitted | None = None  # what the prompt sent, cut or summarized
    loop_cut: int | None = None  # set: the answer looped; it was stopped, kept up to here
    json: bool = False  # /json: the answer is decoded as one JSON object

    @property
    def dropped_turns(self) -> int:
        """Oldest turns left out of the prompt (none summarized them)."""
        return self.fitted.truncated_turns if self.fitted is not None else 0

    def usage(self) -> dict | None:
        """The prompt's budget and what used it (tokens), for the cache panel."""
        f, p = self.fitted, self.prepared
        if f is None:
            return None
        budget, documents = f.budget, 0
        if p is not None:  # a document question: the documents' budget is the prompt's
            b = p.budget
            budget = min(b.total - b.answer, b.prompt or b.total)
            documents = p.placement.tokens
        return {"policy": f.policy, "budget": budget, "history": f.history_tokens,
                "documents": documents, "summary": f.summary.tokens if f.summary else 0,
                "summarized_turns": f.summary.turns if f.summary else 0,
                "left_out": f.truncated_turns, "prompt": len(p.ids) if p else f.prompt_tokens}


@dataclass
class TurnStarted(Message):
    """The engine accepted the request (``notice``: e.g. max tokens reduced to fit)."""

    turn: Turn
    notice: str | None = None


@dataclass
class PrefillProgress(Message):
    """Prompt tokens prefilled so far, out of ``total``."""

    turn: Turn
    done: int
    total: int


@dataclass
class TextReceived(Message):
    """A batch of answer text (the deltas of ~50 ms)."""

    turn: Turn
    text: str


@dataclass
class TurnFinished(Message):
    """The final event: finish reason, stats, error text."""

    turn: Turn
    finish_reason: str
    stats: object | None
    error: str | None = None


@dataclass
class TurnRejected(Message):
    """The engine refused the prompt before generating (empty, too long, engine stopped)."""

    turn: Turn
    error: str
    too_large: bool = False  # it can never fit the context (a paste to attach instead?)


def fit_turn(engine: EngineLike, turn: Turn, history: list[dict] | None = None) -> Fitted:
    """The turn's prompt under its policy; a summary still being written is waited for
    when, without it, turns would be left out."""
    budget = turn.budget or default_chat_budget(engine.max_context)
    history = turn.history if history is None else history
    fitted = fit(history, policy=turn.policy, budget=budget, count=engine.count_tokens,
                 system=turn.system, question=turn.prompt, summary=turn.summary)
    job = turn.pending
    if fitted.truncated_turns and turn.policy == "summarize" and job is not None:
        while not job.done and not turn.cancel_requested:
            job.wait(0.1)
        if job.result is not None:
            turn.summary = job.result
            fitted = fit(history, policy=turn.policy, budget=budget,
                         count=engine.count_tokens, system=turn.system, question=turn.prompt,
                         summary=turn.summary)
    return fitted


def submit_fitting(engine: EngineLike, turn: Turn, params: SamplingParams) -> HandleLike:
    """Submit the turn within its budget; if the engine still finds it too long (the
    budget's count is an estimate), drop the oldest kept turns and retry (reported)."""
    turn.fitted = fitted = fit_turn(engine, turn)
    while True:
        try:
            ids = engine.encode_prompt(turn.prompt, system=fitted.system or None,
                                       history=fitted.history)
            return engine.submit(ids, params, priority=Priority.INTERACTIVE)
        except RequestError:
            if not fitted.history or turn.policy == "error":
                raise
            k = min(2, len(fitted.history))
            fitted.truncated_turns += 1
            fitted.truncated_tokens += sum(engine.count_tokens(m["content"]) for m in
                                           fitted.history[:k])
            fitted.history, fitted.kept_from = fitted.history[k:], fitted.kept_from + k


def submit_documents(engine: EngineLike, turn: Turn, params: SamplingParams) -> HandleLike:
    """Submit the turn as a question about ``turn.documents`` (the budget is theirs).

    A pinned prefix (documents placed whole) is written to the disk cache for a document
    session's lifetime, as ``kvchat ask`` does, so it outlives the tenant's usual TTL.
    """
    assert turn.documents is not None
    turn.prepared = prepared = turn.documents.prepare(
        engine, turn.prompt, answer_tokens=params.max_tokens, history=turn.history,
        chat_system=turn.system, policy=turn.policy, summary=turn.summary)
    turn.fitted = prepared.fitted
    ttl = DEFAULT_SESSION_TTL_S if prepared.prefix_tokens > 0 else None
    return engine.submit(prepared.ids, params, priority=Priority.INTERACTIVE, cache_ttl_s=ttl)


def stream_turn(turn: Turn, params: SamplingParams, post: Callable[[Message], object],
                is_cancelled: Callable[[], bool] = lambda: False) -> None:
    """Run one turn to its end on ``turn.engine``, posting messages; engine errors end it."""
    engine = turn.engine
    try:
        if turn.documents is not None:
            handle = submit_documents(engine, turn, params)
        else:
            handle = submit_fitting(engine, turn, params)
    except (KVChatError, ValueError) as e:
        # over the chat's budget (error policy): the history is long, not the prompt
        too_large = isinstance(e, RequestTooLargeError) and not isinstance(e, ContextBudgetError)
        post(TurnRejected(turn, str(e), too_large))
        return
    turn.request_id = handle.request_id
    post(TurnStarted(turn, getattr(handle, "notice", None)))
    if turn.cancel_requested:  # Esc pressed before the engine had an id for us
        engine.cancel(handle.request_id)
    pending: list[str] = []
    answer = ""
    last_flush = last_prefill = 0.0
    for event in handle:
        now = time.monotonic()
        if event.prefill is not None and now - last_prefill >= PREFILL_REPORT_S:
            last_prefill = now
            post(PrefillProgress(turn, *event.prefill))
        if event.text:
            pending.append(event.text)
        if pending and (event.finish_reason is not None or now - last_flush >= FLUSH_S):
            post(TextReceived(turn, "".join(pending)))
            answer += "".join(pending)
            pending.clear()
            last_flush = now
            if not turn.cancel_requested and (cut := loop_cut(answer)) is not None:
                turn.loop_cut, turn.cancel_requested = cut, True  # stopped: it loops
                engine.cancel(handle.request_id)
        if event.finish_reason is not None:
            post(TurnFinished(turn, event.finish_reason, event.stats, event.error))
            return
        if is_cancelled() and not turn.cancel_requested:
            turn.cancel_requested = True
            engine.cancel(handle.request_id)
    post(TurnFinished(turn, "error", None, "the engine ended the stream without a final event"))


def stats_line(finish_reason: str, stats, error: str | None = None) -> str:
    """The line under an answer: speed, TTFT and cache use, or why it stopped."""
    if finish_reason == "error":
        return f"error: {error or 'generation failed'}"
    released = getattr(stats, "blocks_released", 0) if stats is not None else 0
    if finish_reason == "loop":  # the chat stopped it (cancelled), its repeats cut off
        return ("stopped: the answer began repeating itself; the repeats are not kept · "
                + stats_line("stop", stats))
    if finish_reason == "cancelled":
        return f"cancelled — {released} blocks released"
    if finish_reason == "shutdown":
        return f"stopped: the model was unloaded — {released} blocks released"
    if stats is None:
        return finish_reason
    parts = [
        f"{stats.generation_tokens} tokens",
        f"{stats.decode_tps:.1f} tok/s",
        f"TTFT {stats.ttft_s:.2f} s",
        f"prefill {stats.prefill_tps:.0f} tok/s",
    ]
    cached = getattr(stats, "cached_tokens", 0)
    parts.append(f"{cached}/{stats.prompt_tokens} prompt tokens cached")
    if getattr(stats, "context_shifts", 0):
        parts.append(f"context shifted: {stats.shifted_tokens} tokens dropped")
    if finish_reason == "length":
        parts.append("max tokens reached")
    elif finish_reason == "timeout":
        parts.append("timed out")
    return " · ".join(parts)
