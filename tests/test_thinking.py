"""The thinking budget (`engine.thinking`): after so many tokens inside ``<think>`` the
engine forces ``</think>`` and the answer follows; the tag found however it is cut."""

from __future__ import annotations

import pytest

from engine import Engine, EngineConfig, SamplingParams
from engine.errors import RequestError
from engine.thinking import CLOSE_TEXT, ThinkBudget

CLOSE = [91, 92, 93]  # stand-in token ids of the closing text


def test_budget_counts_tokens_inside_the_tag_then_forces_the_close():
    b = ThinkBudget(3, CLOSE, inside=False)
    for token, text in [(1, " <th"), (2, "ink>"), (3, "plan"), (4, " more")]:
        assert b.next_forced is None
        b.feed(token, text)
    assert b.state == "thinking" and b.used == 2
    b.feed(5, " x")
    assert b.forced == CLOSE and b.next_forced == 91
    for t in CLOSE:
        assert not b.done
        b.feed(t, "")
    assert b.done and b.next_forced is None


def test_no_tag_or_a_closed_one_leaves_the_answer_alone():
    plain = ThinkBudget(1, CLOSE, inside=False)
    plain.feed(1, "Hello")
    assert plain.done and plain.next_forced is None
    closed = ThinkBudget(10, CLOSE, inside=True)
    closed.feed(1, "ok </thi")
    closed.feed(2, "nk> answer")
    assert closed.done and closed.used == 2
    zero = ThinkBudget(0, CLOSE, inside=True)
    assert zero.next_forced == 91  # the very first pick closes it


@pytest.fixture(scope="module")
def engine(quick_model):
    return Engine(quick_model, EngineConfig(kv_budget_bytes=64 << 20))


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_engine_forces_the_close_after_the_budget(engine, temperature):
    ids = engine.encode_prompt("Solve 12 * 7. <think>\n", raw=True)
    close = engine.think_close
    for budget in (0, 5):
        r = engine.generate_text(ids, SamplingParams(
            max_tokens=budget + len(close) + 6, thinking_budget=budget, thinking=True,
            temperature=temperature, seed=3, ignore_eos=True))
        assert r.tokens[budget:budget + len(close)] == close
        assert CLOSE_TEXT.strip() not in engine.tokenizer.decode(r.tokens[:budget])
        assert len(r.tokens) == budget + len(close) + 6  # the answer goes on after it
    free = engine.generate_text(ids, SamplingParams(max_tokens=12, ignore_eos=True))
    assert free.tokens[5:5 + len(close)] != close  # unforced, the model says something else
    assert engine.metrics().blocks_used == 0


def test_budget_and_a_grammar_are_refused_together(engine):
    from engine import Constraint

    with pytest.raises(RequestError):
        engine.submit([1, 2, 3], SamplingParams(thinking_budget=4,
                                                constraint=Constraint("json_object")))
