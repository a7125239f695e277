"""Questions about documents through one engine: budget, placement, prompt ids.

`DocumentQA.prepare` is the whole policy for one question, shared by ``kvchat ask`` and
the TUI: it sizes the budget from the engine's context and free KV memory, keeps the
recent conversation that fits, places the documents (whole, as a pinned prefix, or the
most relevant chunks), and returns the prompt's ids with a report of what was left out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from app.context_policy import Fitted, Summary, fit
from app.documents import budgets
from app.documents.chunks import DEFAULT_CHUNK_TOKENS, Chunk, split_document
from app.documents.counting import sliced_counter
from app.documents.load import Document
from app.documents.policy import HISTORY_SHARE, Budget, Placement, place
from app.engine_like import EngineLike

SYSTEM = ("You answer questions about the documents below. Use only what they say, quote "
          "numbers and names exactly, and say so when the answer is not in them.")
TEMPLATE_TOKENS = 32  # chat-template tokens around the system text and the question


@dataclass(slots=True)
class Prepared:
    """One question, ready to submit."""

    ids: list[int]
    prefix_tokens: int  # ids[:prefix_tokens] are the same for every question (whole mode)
    budget: Budget
    placement: Placement
    history: list[dict]  # the turns kept
    fitted: Fitted | None = None  # the history under the context policy

    @property
    def dropped_turns(self) -> int:
        return self.fitted.truncated_turns if self.fitted is not None else 0

    def report(self, docs: Sequence[Document]) -> str:
        """What went into the prompt and what did not, in one line."""
        notes = self.fitted.notes() if self.fitted is not None else []
        return "; ".join([self.placement.summary(docs), *notes])

    def to_dict(self) -> dict:
        f = self.fitted
        return {"budget": self.budget.to_dict(), "prompt_tokens": len(self.ids),
                "prefix_tokens": self.prefix_tokens, "placement": self.placement.to_dict(),
                "dropped_turns": self.dropped_turns,
                "dropped_turn_tokens": f.truncated_tokens if f is not None else 0,
                "context": f.to_dict() if f is not None else None}


class DocumentQA:
    """Documents attached to a conversation with ``engine``."""

    def __init__(self, engine: EngineLike, docs: Sequence[Document], *,
                 chunk_tokens: int = DEFAULT_CHUNK_TOKENS, system: str = SYSTEM,
                 prompt_budget: int | None = None):
        if not docs:
            raise ValueError("no documents")
        self.engine, self.docs, self.system = engine, list(docs), system
        # the prompt's ceiling: measured for this model, or given (`app.documents.budgets`)
        self.prompt_budget, self.budget_source = budgets.prompt_budget(engine.loaded,
                                                                       prompt_budget)
        self.chunk_tokens = chunk_tokens
        self.count = sliced_counter(engine.count_tokens)  # memory bounded by a slice
        self.doc_tokens = [self.count(d.text) for d in self.docs]
        self._chunks: list[Chunk] | None = None

    @property
    def total_tokens(self) -> int:
        return sum(self.doc_tokens)

    def chunks(self) -> list[Chunk]:
        """Every document cut into chunks (computed once)."""
        if self._chunks is None:
            self._chunks = [c for i, d in enumerate(self.docs)
                            for c in split_document(d, i, self.count,
                                                    self.chunk_tokens)]
        return self._chunks

    def budget(self, answer_tokens: int, fixed: int) -> Budget:
        m = self.engine.metrics()
        block = m.bytes_per_block // m.bytes_per_token if m.bytes_per_token else 1
        free = m.blocks_free * block if m.blocks_total else self.engine.max_context
        return Budget(self.engine.max_context, free, answer_tokens, fixed, self.prompt_budget,
                      self.budget_source)

    def prepare(self, question: str, *, answer_tokens: int, history: Sequence[dict] = (),
                policy: str = "truncate", summary: Summary | None = None) -> Prepared:
        """Budget, placement and ids for ``question`` (see the module docstring).

        Earlier turns may take a quarter of what the question leaves; beyond it ``policy``
        (`app.context_policy`) applies: a summary stands for the oldest, or they are left
        out, or (``error``) the question is refused.
        """
        count = self.count
        base = count(self.system) + count(question) + TEMPLATE_TOKENS
        budget = self.budget(answer_tokens, base)  # one metrics snapshot per question
        room = budget.total - answer_tokens
        if budget.prompt is not None:
            room = min(room, budget.prompt)
        share = max(0, (room - base) // HISTORY_SHARE)
        fitted = fit(history, policy=policy, budget=share, count=count, summary=summary)
        kept = fitted.history
        if fitted.summary is not None:  # after the documents: their prefix stays the same
            kept = [{"role": "user", "content": fitted.system},
                    {"role": "assistant", "content": "Noted."}, *kept]
        budget = replace(budget, fixed=base + sum(count(m["content"]) + 4 for m in kept))
        placement = place(self.docs, self.chunks, question, budget.documents, count,
                          at_least=self.total_tokens)
        ids, prefix = self.engine.encode_pinned(placement.text, question, system=self.system,
                                                history=kept)
        return Prepared(ids, prefix if placement.mode == "whole" else 0, budget, placement,
                        kept, fitted)
