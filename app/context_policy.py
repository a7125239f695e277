"""The context policy: what a conversation sends once it outgrows its budget.

One module for the chat (`app.tui`), ``kvchat ask`` and ``kvchat serve``. The budget is a
ceiling on the prompt (system text, summary, the turns kept, pinned documents and the
question; the answer comes on top), set well below the model's context by default for
the chat: a window is a ceiling, not a quota. Over the budget:

- ``summarize``: the model condenses the oldest turns into a summary
  (`app.context_summary`: background requests started right after an answer, so the
  next question rarely waits);
  the summary follows the system text, a stable prefix whose KV blocks are cached like
  any other. Turns it does not cover yet, while still over the budget, are left out;
- ``truncate``: the oldest turns are left out (never the system text or documents);
- ``error``: nothing is cut; the prompt is refused.

Every cut and every summary is reported (`Fitted.notes`, `Fitted.to_dict`): nothing
goes silently.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from engine.errors import RequestTooLargeError

POLICIES = ("summarize", "truncate", "error")
TURN_OVERHEAD = 4  # chat-template tokens around one message (ChatML adds ~5)
SUMMARY_TRIGGER = 0.75  # summarize once the conversation passes this share of the budget
SUMMARY_KEEP = 1 / 3  # ... down to this share, in the newest turns kept verbatim


def default_chat_budget(context: int) -> int:
    """The chat's prompt budget: a quarter of the context (2,048 of the default's 8,192)."""
    return min(context, max(512, context // 4))


class ContextBudgetError(RequestTooLargeError):
    """A prompt over its budget under the ``error`` policy (nothing is cut)."""


@dataclass(slots=True)
class Summary:
    """The model's summary of the first ``messages`` history messages (user/assistant)."""

    messages: int  # history messages it stands for: history[:messages]
    source_tokens: int  # what they took
    tokens: int  # what the summary takes
    text: str

    @property
    def turns(self) -> int:
        return (self.messages + 1) // 2

    def label(self) -> str:
        """"turns 1–6 summarized (1,412 → 180 tokens)"."""
        span = "turn 1" if self.turns == 1 else f"turns 1–{self.turns}"
        return f"{span} summarized ({self.source_tokens:,} → {self.tokens:,} tokens)"

    def system_text(self, system: str = "") -> str:
        """The system text with the summary after it (the stable prefix of each prompt)."""
        part = f"Summary of the earlier conversation ({self.label()}):\n{self.text}"
        return f"{system}\n\n{part}" if system else part

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict | None) -> Summary | None:
        if not data:
            return None
        return cls(int(data["messages"]), int(data["source_tokens"]), int(data["tokens"]),
                   str(data["text"]))


@dataclass(slots=True)
class Fitted:
    """What one prompt sends under the policy, and what it left out or stood in for."""

    policy: str
    budget: int
    system: str  # the system text, with the summary when one is used
    history: list[dict]  # the messages sent
    summary: Summary | None = None  # the summary sent (it stands for history[:messages])
    truncated_turns: int = 0  # oldest turns left out, beyond what the summary covers
    truncated_tokens: int = 0
    history_tokens: int = 0  # of the messages sent
    prompt_tokens: int = 0  # the whole prompt, by the same count
    kept_from: int = 0  # history[kept_from:] is what was sent

    def notes(self) -> list[str]:
        """One line per cut or summary, for the transcript, the CLI and logs."""
        out = []
        if self.summary is not None:
            out.append(self.summary.label())
        if self.truncated_turns:
            why = ("the summary does not cover them yet" if self.policy == "summarize"
                   else "--context-policy truncate")
            out.append(f"{self.truncated_turns} oldest turn(s) left out "
                       f"({self.truncated_tokens:,} tokens; {why})")
        return out

    def to_dict(self) -> dict:
        s = self.summary
        return {"policy": self.policy, "budget": self.budget,
                "truncated_turns": self.truncated_turns,
                "truncated_tokens": self.truncated_tokens,
                "summarized_turns": s.turns if s is not None else 0,
                "summary": s.to_dict() if s is not None else None,
                "history_tokens": self.history_tokens, "prompt_tokens": self.prompt_tokens}


def message_tokens(messages: Sequence[dict], count: Callable[[str], int]) -> list[int]:
    return [count(m.get("content") or "") + TURN_OVERHEAD for m in messages]


def fit(history: Sequence[dict], *, policy: str, budget: int, count: Callable[[str], int],
        system: str = "", question: str = "", fixed: int = 0,
        summary: Summary | None = None) -> Fitted:
    """The history a prompt of ``question`` sends within ``budget`` tokens under ``policy``.

    ``fixed``: tokens the caller adds (pinned documents). History goes in user/assistant
    pairs, so what is kept never starts mid-exchange. A summary is used (summarize only)
    when it covers a prefix of ``history``. Raises `ContextBudgetError` under ``error``.
    """
    if policy not in POLICIES:
        raise ValueError(f"context policy must be one of {', '.join(POLICIES)}")
    used = summary if (policy == "summarize" and summary is not None
                       and 0 < summary.messages <= len(history)) else None
    start = used.messages if used is not None else 0
    system_out = used.system_text(system) if used is not None else system
    sizes = message_tokens(history[start:], count)
    base = count(system_out) + count(question) + 2 * TURN_OVERHEAD + fixed
    total = base + sum(sizes)
    if total > budget and policy == "error":
        raise ContextBudgetError(
            f"the conversation takes {total:,} tokens, over its budget of {budget:,} "
            "(--context-policy error); summarize or truncate would shorten it")
    dropped = dropped_tokens = 0
    while sizes and base + sum(sizes) > budget:
        k = 2 if len(sizes) >= 2 else 1  # one user + assistant pair
        dropped, dropped_tokens = dropped + 1, dropped_tokens + sum(sizes[:k])
        del sizes[:k]
        start += k
    return Fitted(policy, budget, system_out, list(history[start:]), used, dropped,
                  dropped_tokens, sum(sizes), base + sum(sizes), start)


def plan_summary(history: Sequence[dict], summary: Summary | None, *, budget: int,
                 count: Callable[[str], int], system: str = "") -> int:
    """History messages a new summary should cover, or 0 when the conversation fits.

    Past `SUMMARY_TRIGGER` of the budget, the oldest turns not yet summarized are
    condensed until the rest is within `SUMMARY_KEEP` of it; the newest turn stays.
    """
    start = summary.messages if summary is not None and summary.messages <= len(history) else 0
    sizes = message_tokens(history[start:], count)
    head = count(system) + (summary.tokens if start else 0)
    if head + sum(sizes) <= SUMMARY_TRIGGER * budget or len(sizes) < 4:
        return 0
    end = 0
    while len(sizes) - end > 2 and head + sum(sizes[end:]) > SUMMARY_KEEP * budget:
        end += 2
    return start + end if end else 0


def add_context_args(p, *, default: str, budget_help: str) -> None:
    """``--context-policy`` and ``--context-budget`` on a command's parser."""
    from app import arg_types

    p.add_argument("--context-policy", choices=POLICIES, default=default,
                   help=f"over the budget: the model summarizes the oldest turns, they are "
                        f"left out (truncate), or the prompt is refused (error) ({default})")
    p.add_argument("--context-budget", type=arg_types.int_in(64), default=None,
                   metavar="TOKENS", help=budget_help)
