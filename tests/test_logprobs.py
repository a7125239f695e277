"""Log-probabilities of generated tokens (`engine.logprobs`): the model's raw log-softmax,
checked against one dense mlx-lm forward of the same weights over prompt + answer."""

from __future__ import annotations

import mlx.core as mx
import pytest

from engine import Engine, EngineConfig, SamplingParams
from engine.errors import RequestError
from engine.logprobs import TokenLogprob, of_rows
from engine.speculation import Speculator

TOL = 2e-3  # paged float32 decode vs one dense forward: summation order differs


def dense_logprobs(model, ids: list[int]) -> mx.array:
    """(len(ids), vocab) log-softmax of mlx-lm's forward, no cache: row i predicts i+1."""
    logits = model(mx.array(ids)[None])[0].astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def check_against(ref: mx.array, prompt_len: int, lps: list[TokenLogprob], k: int):
    for i, lp in enumerate(lps):
        row = ref[prompt_len - 1 + i]
        assert abs(lp.logprob - row[lp.token].item()) < TOL
        assert len(lp.top) == k
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
        want = mx.sort(row)[::-1][:k].tolist()
        assert max(abs(v - w) for (_, v), w in zip(lp.top, want, strict=True)) < TOL
        for t, v in lp.top:
            assert abs(row[t].item() - v) < TOL


@pytest.fixture(scope="module")
def engine(default_model):
    return Engine(default_model, EngineConfig(kv_budget_bytes=64 << 20))


def test_greedy_logprobs_equal_mlx_lm_log_softmax(engine, default_model):
    ids = engine.encode_prompt("What is the capital of France?")
    r = engine.generate_text(ids, SamplingParams(max_tokens=12, logprobs=5))
    assert len(r.logprobs) == len(r.tokens) and r.tokens
    ref = dense_logprobs(default_model.model, ids + r.tokens)
    check_against(ref, len(ids), r.logprobs, 5)
    for tok, lp in zip(r.tokens, r.logprobs, strict=True):
        assert lp.token == tok and lp.top[0][0] == tok  # greedy: the chosen token is top-1
        assert lp.logprob == lp.top[0][1]


def test_sampled_logprobs_are_the_raw_distribution_and_others_pay_nothing(engine,
                                                                          default_model):
    ids = engine.encode_prompt("Write a haiku about the sea.")
    sampled = SamplingParams(max_tokens=10, temperature=1.5, top_k=5, seed=7, logprobs=3,
                             ignore_eos=True, presence_penalty=1.0)
    h1 = engine.submit(ids, sampled)
    h2 = engine.submit(ids, SamplingParams(max_tokens=10, ignore_eos=True))
    from engine.generation import collect

    a, b = collect(h1), collect(h2)
    assert b.logprobs == [] and len(a.logprobs) == 10
    check_against(dense_logprobs(default_model.model, ids + a.tokens), len(ids), a.logprobs, 3)
    # top_k=5 sampling: every chosen token is among the raw top 5 (top 3 reported)
    ref = dense_logprobs(default_model.model, ids + a.tokens)
    for i, lp in enumerate(a.logprobs):
        assert lp.logprob >= mx.sort(ref[len(ids) - 1 + i])[-5].item() - TOL


def test_zero_alternatives_and_the_limit(engine):
    ids = engine.encode_prompt("Hi")
    r = engine.generate_text(ids, SamplingParams(max_tokens=3, logprobs=0))
    assert r.logprobs and all(lp.top == [] and lp.logprob <= 0 for lp in r.logprobs)
    for bad in (21, -1, True, 2.0):
        with pytest.raises(RequestError):
            engine.submit(ids, SamplingParams(max_tokens=3, logprobs=bad))


def test_rows_helper_sorts_and_breaks_ties_by_id():
    logits = mx.array([[0.0, 2.0, 2.0, -1.0], [5.0, 0.0, 0.0, 0.0]])
    a, b = of_rows(logits, [2, 0], [3, 1])
    assert [t for t, _ in a.top] == [1, 2, 0] and a.logprob == a.top[1][1]
    assert b.top == [(0, b.logprob)] and b.logprob > -0.1


def test_speculative_steps_report_each_accepted_tokens_own_row(default_model, monkeypatch):
    """Lookup drafts accepted in one step get the logprobs of their own verify rows:
    equal to plain decoding's, token for token."""
    monkeypatch.setattr(Speculator, "_allot", lambda self, cands, *_: dict(cands))
    on = Engine(default_model, EngineConfig(kv_budget_bytes=64 << 20, speculate="lookup"))
    off = Engine(default_model, EngineConfig(kv_budget_bytes=64 << 20))
    text = ("The lighthouse keeper wrote the weather in a blue notebook every morning, "
            "then climbed the stairs to polish the lamp and count the ships in the bay. ")
    ids = off.encode_prompt(text * 2 + text[:40], raw=True)
    p = SamplingParams(max_tokens=16, ignore_eos=True, logprobs=2)
    spec, plain = on.generate_text(ids, p), off.generate_text(ids, p)
    assert on.metrics().spec_accepted > 0 and spec.tokens == plain.tokens
    for s, q in zip(spec.logprobs, plain.logprobs, strict=True):
        assert s.token == q.token and abs(s.logprob - q.logprob) < TOL
        assert [t for t, _ in s.top] == [t for t, _ in q.top]
    assert on.metrics().blocks_used == 0
