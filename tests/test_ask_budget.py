"""Document questions under a prompt budget (app.documents.budgets) and the context
policy (app.context_policy), on the TUI tests' scripted engine: no model needed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from test_tui_fakes import FakeEngine

from app.context_policy import ContextBudgetError, Summary
from app.documents.budgets import MEASURED, UNMEASURED, prompt_budget
from app.documents.load import Document
from app.documents.qa import DocumentQA

DEFAULT = next(iter(MEASURED))  # the default model's fingerprint


def doc(words: int) -> Document:
    text = " ".join(f"Sentence {i} says little." for i in range(words // 4))
    return Document("d.txt", "text", text, "0" * 64, "/tmp/d.txt")


def engine(fingerprint: str) -> FakeEngine:
    e = FakeEngine(max_prompt_tokens=8192)
    e.loaded = SimpleNamespace(weight_format="fake", name="fake", fingerprint=fingerprint)
    # a pool as large as the context: the budget is the context's, or the measured one
    e.metrics = lambda: SimpleNamespace(bytes_per_block=0, bytes_per_token=0, blocks_free=0,
                                        blocks_total=0)
    return e


def test_measured_model_takes_retrieval_past_its_budget_an_unmeasured_one_does_not():
    tokens, source = prompt_budget(SimpleNamespace(fingerprint=DEFAULT))
    assert tokens == 2048 and "measured" in source
    assert prompt_budget(SimpleNamespace(fingerprint="x")) == (None, UNMEASURED)
    assert prompt_budget(SimpleNamespace(fingerprint=DEFAULT), 999) == (999, "--context-budget")
    long = doc(4000)
    p = DocumentQA(engine(DEFAULT), [long]).prepare("What does sentence 7 say?",
                                                     answer_tokens=64)
    assert p.placement.mode == "retrieval" and len(p.ids) <= 2048 + 64
    assert p.budget.to_dict()["prompt"] == 2048 and "measured" in p.budget.source
    q = DocumentQA(engine("x"), [long]).prepare("What does sentence 7 say?", answer_tokens=64)
    assert q.placement.mode == "whole" and q.budget.source == UNMEASURED
    small = DocumentQA(engine(DEFAULT), [doc(1000)]).prepare("q?", answer_tokens=64)
    assert small.placement.mode == "whole" and small.prefix_tokens > 0


def test_a_summary_follows_the_documents_so_their_prefix_stays():
    e = engine(DEFAULT)
    qa = DocumentQA(e, [doc(800)])
    history = [{"role": r, "content": "w " * 150} for _ in range(4) for r in ("user", "assistant")]
    s = Summary(messages=6, source_tokens=900, tokens=6, text="the code is 4817")
    plain = qa.prepare("q?", answer_tokens=64)
    p = qa.prepare("q?", answer_tokens=64, history=history, policy="summarize", summary=s)
    assert p.prefix_tokens == plain.prefix_tokens and p.ids[:p.prefix_tokens] == plain.ids[
        :plain.prefix_tokens]
    assert "the code is 4817" in e.histories[-1][0]["content"]
    assert p.to_dict()["context"]["summarized_turns"] == 3
    assert "turns 1–3 summarized" in p.report(qa.docs)


def test_error_policy_refuses_a_history_over_its_share():
    qa = DocumentQA(engine(DEFAULT), [doc(800)])
    history = [{"role": r, "content": "w " * 400} for _ in range(4) for r in ("user", "assistant")]
    with pytest.raises(ContextBudgetError):
        qa.prepare("q?", answer_tokens=64, history=history, policy="error")
    p = qa.prepare("q?", answer_tokens=64, history=history, policy="truncate")
    assert p.dropped_turns >= 1 and "left out" in p.report(qa.docs)
