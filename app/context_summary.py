"""Summaries for the ``summarize`` context policy: the model condenses the oldest turns.

A 135M-parameter model rewrites one short exchange faithfully (it mostly copies names and
numbers) but loses facts when asked to summarize a long stretch at once, and its greedy
output loops when asked to merge many notes, so a summary is built as notes: one
background request per condensed turn writes that turn's note (its first sentence); the
notes are appended to the previous summary's. When the notes outgrow their cap (half the
budget), the notes that ran on to their length limit are shortened one by one, oldest
first (a short input it copies from; a stated fact's note ends its sentence before the
limit, so it is left as written); only if that is not enough does one request condense
the older half.
Every request runs at background priority: a question asked meanwhile is served first
(`engine.request.Priority`).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from app.context_policy import Summary, message_tokens, plan_summary

SYSTEM = "You write concise, faithful notes."
NOTE_ASK = "Rewrite this exchange as one short note, keeping every name and number exactly."
SHORTEN_ASK = "Shorten this note to a few words, keeping every name and number exactly."
CONDENSE_ASK = "Shorten these notes into a few lines. Keep every name and number exactly."
NOTE_TOKENS = 24
SHORT_TOKENS = 12  # a ran-on note is shortened to this, when the notes outgrow their cap
RAN_ON = "…"  # ends a note cut at its length limit (a fact's note ends its sentence first)
LABELS = ("User: ", "Assistant: ")  # a note that copies the exchange starts with one
# a condensing request's greedy 135M output loops ("1788, 1788, 1788, ...") without it; a
# note's must not have it: it copies numbers, and 8566 came out as 856 under it
REPETITION_PENALTY = 1.3
MAX_TURN_CHARS = 2000  # of one message, in a note's request (the rest is not read)


def note_prompt(user: str, assistant: str | None) -> str:
    """The note request of one exchange (``assistant`` None: the user's message alone)."""
    if assistant is None:
        return f"User: {user[:MAX_TURN_CHARS]}\n\n{NOTE_ASK.replace('exchange', 'message')}"
    return (f"User: {user[:MAX_TURN_CHARS]}\nAssistant: {assistant[:MAX_TURN_CHARS]}"
            f"\n\n{NOTE_ASK}")


def looping(note: str) -> bool:
    """A note that repeats itself ("I'm sorry, I'm sorry, I'm sorry, …")."""
    words = note.split()
    return len(words) >= 6 and len(set(words)) <= len(words) // 2


def shorten_prompt(note: str) -> str:
    return f"Note: {note.removeprefix('- ')}\n\n{SHORTEN_ASK}"


def condense_prompt(notes: Sequence[str]) -> str:
    return "Notes:\n" + "\n".join(notes) + f"\n\n{CONDENSE_ASK}"


@dataclass(eq=False)
class SummaryJob:
    """The summary of ``history[:upto]``: `run` it (a thread), `wait` for it, `cancel` it.

    Its result is None when it was cancelled or failed (``error`` says why).
    """

    engine: object
    history: list[dict]
    previous: Summary | None
    upto: int  # history messages the new summary covers
    max_tokens: int = 512  # the notes' cap, beyond which the older half is condensed
    tenant: str = "local"
    permission_version: int = 0
    result: Summary | None = None
    error: str | None = None
    requests: int = 0  # model requests it made
    _done: threading.Event = field(default_factory=threading.Event)
    _handle: object | None = None
    _cancelled: bool = False

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def _ask(self, prompt: str, max_tokens: int, stop: list[str],
             repetition_penalty: float | None = None) -> str:
        from engine import SamplingParams
        from engine.generation import collect
        from engine.request import Priority

        if self._cancelled:
            raise InterruptedError("cancelled")
        ids = self.engine.encode_prompt(prompt, system=SYSTEM)
        self._handle = handle = self.engine.submit(
            ids, SamplingParams(max_tokens=max_tokens, stop=stop,
                                repetition_penalty=repetition_penalty),
            priority=Priority.BACKGROUND, tenant=self.tenant,
            permission_version=self.permission_version)
        self.requests += 1
        if self._cancelled:
            handle.cancel()
        r = collect(handle)
        if r.finish_reason not in ("stop", "length"):
            raise InterruptedError(r.error or f"a summary request ended: {r.finish_reason}")
        text = " ".join(r.text.split())
        return f"{text} {RAN_ON}" if text and r.finish_reason == "length" else text

    def run(self) -> Summary | None:
        from engine.errors import KVChatError

        eng, prev = self.engine, self.previous
        start = prev.messages if prev is not None else 0
        notes = prev.text.splitlines() if prev is not None else []
        try:
            for i in range(start, self.upto, 2):
                user = self.history[i].get("content") or ""
                reply = self.history[i + 1].get("content") or "" if i + 1 < self.upto else ""
                note = self._ask(note_prompt(user, reply), NOTE_TOKENS, ["\n", ". "])
                if looping(note):  # once more from the user's message alone
                    note = self._ask(note_prompt(user, None), NOTE_TOKENS, ["\n", ". "])
                for label in LABELS:
                    note = note.removeprefix(label)
                if note:
                    notes.append(f"- {note}")
            for j, note in enumerate(notes):  # over the cap: the ran-on notes, oldest first
                if eng.count_tokens("\n".join(notes)) <= self.max_tokens:
                    break
                if note.endswith(RAN_ON):
                    short = self._ask(shorten_prompt(note.removesuffix(RAN_ON)), SHORT_TOKENS,
                                      ["\n", ". "]).removesuffix(RAN_ON).rstrip()
                    notes[j] = f"- {short}" if short else note
            if eng.count_tokens("\n".join(notes)) > self.max_tokens and len(notes) > 2:
                half = len(notes) // 2
                short = self._ask(condense_prompt(notes[:half]), self.max_tokens // 2, [],
                                  REPETITION_PENALTY)
                notes = [f"- {short}"] * bool(short) + notes[half:]
            text = "\n".join(notes)
            if not text:
                raise InterruptedError("the model wrote no summary")
            source = (prev.source_tokens if prev is not None else 0) + sum(
                message_tokens(self.history[start:self.upto], eng.count_tokens))
            self.result = Summary(self.upto, source, eng.count_tokens(text), text)
        except (KVChatError, ValueError, RuntimeError, InterruptedError) as e:
            self.error = str(e)
        finally:
            self._done.set()
        return self.result

    def wait(self, timeout: float | None = None) -> Summary | None:
        self._done.wait(timeout)
        return self.result

    def cancel(self) -> None:
        self._cancelled = True
        handle = self._handle
        if handle is not None:
            handle.cancel()


def summary_job(engine, history: Sequence[dict], summary: Summary | None, *, budget: int,
                system: str = "", **kwargs) -> SummaryJob | None:
    """A `SummaryJob` (not started) when the conversation needs one, else None."""
    upto = plan_summary(history, summary, budget=budget, count=engine.count_tokens,
                        system=system)
    if not upto:
        return None
    return SummaryJob(engine, list(history), summary, upto, max_tokens=max(64, budget // 2),
                      **kwargs)
