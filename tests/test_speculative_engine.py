"""Speculative decoding in the engine: greedy tokens identical to plain decoding, alone and
batched, under preemption and quantized KV; cancellation at any step leaks nothing."""

from __future__ import annotations

import random

import pytest

from engine import Engine, EngineConfig, SamplingParams
from engine.speculation import Speculator

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers greater than 100.",
    "Give me a recipe for pancakes.",
]
GEN = 40


def params(n=GEN, **kw):
    return SamplingParams(max_tokens=n, ignore_eos=True, **kw)


def copy_prompt(engine: Engine) -> list[int]:
    """A text and its own beginning again: the model goes on copying (lookup's home)."""
    text = ("The lighthouse keeper wrote the weather in a blue notebook every morning, "
            "then climbed the stairs to polish the lamp and count the ships in the bay. ")
    return engine.encode_prompt(text * 2 + text[:40], raw=True)


@pytest.fixture
def every_draft(monkeypatch):
    """Verify every lookup candidate, whatever it costs: the harshest test of verification
    (the measured allotment alone would verify fewer)."""
    monkeypatch.setattr(Speculator, "_allot", lambda self, cands, *_: dict(cands))


def run(engine: Engine, prompts, p=None):
    handles = [engine.submit(i, p or params()) for i in prompts]
    return [[e.token for e in h if e.token is not None] for h in handles]


@pytest.fixture(scope="module")
def plain(quick_model):
    engine = Engine(quick_model, EngineConfig(kv_budget_bytes=64 << 20))
    ids = [engine.encode_prompt(p) for p in PROMPTS] + [copy_prompt(engine)]
    return ids, [engine.generate_text(i, params()).tokens for i in ids]


def check_clean(engine: Engine):
    m = engine.metrics()
    assert m.blocks_used == 0 and m.blocks_free == m.blocks_total
    engine.blocks.check_invariants()
    assert not engine.speculator.states


def test_lookup_alone_engages_and_equals_plain(quick_model, plain):
    """The measured allotment speculates on a copying answer; tokens stay plain decoding's."""
    ids, ref = plain
    engine = Engine(quick_model, EngineConfig(kv_budget_bytes=64 << 20, speculate="lookup"))
    result = engine.generate_text(ids[-1], params())
    assert result.tokens == ref[-1]
    s = result.stats
    assert s.spec_accepted > GEN // 4, (s.spec_proposed, s.spec_accepted)
    m = engine.metrics()
    assert (m.spec_proposed, m.spec_accepted) == (s.spec_proposed, s.spec_accepted)
    assert m.steps < GEN  # several tokens per step
    check_clean(engine)


def test_batched_every_draft_equals_plain(quick_model, plain, every_draft):
    ids, ref = plain
    engine = Engine(quick_model, EngineConfig(kv_budget_bytes=64 << 20, max_running=8,
                                              speculate="lookup"))
    assert run(engine, ids) == ref
    assert engine.metrics().spec_accepted > 0
    check_clean(engine)


@pytest.mark.parametrize(("mode", "source"), [("recompute", "lookup"), ("swap", "lookup"),
                                              ("recompute", "draft:given")])
def test_preempted_speculating_sequences_resume_exactly(quick_model, plain, every_draft, mode,
                                                        source):
    ids, ref = plain
    probe = Engine(quick_model, EngineConfig(kv_budget_bytes=1 << 20))
    need = sum(-(-(len(i) + GEN) // 16) for i in ids)
    engine = Engine(quick_model, EngineConfig(
        kv_budget_bytes=need // 3 * probe.layout.bytes_per_block, max_running=5,
        preempt_mode=mode, speculate=source), draft=quick_model)
    engine.speculator.config.fixed = 2 if source != "lookup" else None
    assert run(engine, ids) == ref
    m = engine.metrics()
    assert m.preemptions > 0 and m.spec_accepted > 0
    check_clean(engine)


def test_quantized_kv_every_draft_equals_plain(quick_model, every_draft):
    cfg = dict(kv_budget_bytes=64 << 20, kv_bits=8)
    off = Engine(quick_model, EngineConfig(**cfg))
    on = Engine(quick_model, EngineConfig(**cfg, speculate="lookup"))
    ids = [copy_prompt(off), off.encode_prompt(PROMPTS[1])]
    assert run(on, ids) == run(off, ids)
    assert on.metrics().spec_accepted > 0
    check_clean(on)


@pytest.mark.parametrize("block_size", [16, 4])
def test_residual_kv_every_draft_equals_plain(quick_model, every_draft, monkeypatch,
                                              block_size):
    """The residual formats (q4-kivi): a verify step that fills a block with drafts later
    rejected quantized it; `reopen` takes it back to its exact rows, so the tokens and the
    stored bytes stay plain decoding's. Blocks of 4 make that frequent."""
    from engine.kvcache.residual import ResidualKVCache

    reopened = []
    original = ResidualKVCache.reopen

    def counting(self, block):
        reopened.append(did := original(self, block))
        return did

    monkeypatch.setattr(ResidualKVCache, "reopen", counting)
    cfg = dict(kv_budget_bytes=64 << 20, kv_bits=4, kv_residual=True, kv_key_channel=True,
               block_size=block_size, max_running=4)
    off = Engine(quick_model, EngineConfig(**cfg))
    on = Engine(quick_model, EngineConfig(**cfg, speculate="lookup"))
    ids = [copy_prompt(off), off.encode_prompt(PROMPTS[1]), off.encode_prompt(PROMPTS[3])]
    ref = [off.generate_text(i, params()).tokens for i in ids]  # alone, plain
    assert run(on, ids) == ref  # batched, speculating
    assert on.generate_text(ids[0], params()).tokens == ref[0]  # alone, prefix cached
    assert on.metrics().spec_accepted > 0
    assert any(reopened), "no verify step filled a block its drafts then gave back"
    check_clean(on)
    on.kv.reclaim()
    assert on.kv.num_residual_blocks == 0


def test_cancel_at_any_step_leaks_nothing(quick_model, plain, every_draft):
    ids, _ = plain
    engine = Engine(quick_model, EngineConfig(kv_budget_bytes=64 << 20, max_running=8,
                                              speculate="lookup"))
    rng = random.Random(3)
    for _ in range(4):
        handles = [engine.submit(i, params()) for i in ids]
        for _ in range(rng.randrange(1, 12)):
            engine.step()
        for h in rng.sample(handles, 3):
            h.cancel()
        engine.step()
        engine.blocks.check_invariants()
        for h in handles:
            h.cancel()
        engine.step()
    assert engine.metrics().spec_proposed > 0
    check_clean(engine)


def test_sampled_and_stopped_requests_speculate(quick_model, every_draft):
    engine = Engine(quick_model, EngineConfig(kv_budget_bytes=64 << 20, speculate="lookup"))
    ids = copy_prompt(engine)
    sampled = engine.generate_text(ids, params(temperature=0.7, seed=5))
    again = engine.generate_text(ids, params(temperature=0.7, seed=5))
    assert sampled.tokens == again.tokens  # seeded: reproducible with speculation too
    assert sampled.stats.spec_proposed > 0
    # a stop string inside accepted drafts ends the answer there, its text not emitted
    text = engine.generate_text(ids, params()).text
    stop = text[10:16]
    cut = engine.generate_text(ids, params(stop=[stop]))
    assert cut.finish_reason == "stop" and cut.text == text[:text.index(stop)]
    check_clean(engine)


@pytest.mark.parametrize("which", ["self", "tiny"])
def test_draft_model_equals_plain(quick_model, tiny_model, plain, which):
    ids, ref = plain
    draft = quick_model if which == "self" else tiny_model
    engine = Engine(quick_model, EngineConfig(kv_budget_bytes=64 << 20, max_running=8,
                                              speculate="draft:given"), draft=draft)
    engine.speculator.config.fixed = 3  # every step drafts: verification is what is tested
    engine.speculator.draft.catch_up = 8  # prompts are caught up over several steps
    assert engine.generate_text(ids[0], params()).tokens == ref[0]  # alone
    assert run(engine, ids) == ref  # batched, sequences at different lengths
    m = engine.metrics()
    assert m.spec_proposed > 0
    if which == "self":  # the same weights guess right (batched rows may round apart)
        assert m.spec_accepted > 0.8 * m.spec_proposed
    check_clean(engine)
    d = engine.speculator.draft
    assert d.blocks.num_free_blocks == d.blocks.num_blocks and not d.fed


def test_constrained_drafts_keep_the_grammar(quick_model, every_draft):
    """A grammar request speculates too: drafts it would refuse are cut, each verify row is
    masked by the grammar's state at that row; greedy and seeded sampled output equal
    plain decoding's and parse."""
    import json

    from engine.constraint import Constraint

    schema = {"type": "object", "properties": {
        "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                   "minItems": 6, "maxItems": 6}}, "required": ["colors"]}
    c = Constraint.json_schema(schema)
    off = Engine(quick_model, EngineConfig(kv_budget_bytes=64 << 20))
    on = Engine(quick_model, EngineConfig(kv_budget_bytes=64 << 20, speculate="lookup"))
    ids = off.encode_prompt('List six colors as JSON: {"colors": ["red", "green", "blue", '
                            '"red", "green", "blue"]}. Again:')
    for p in (SamplingParams(max_tokens=60, constraint=c),
              SamplingParams(max_tokens=60, constraint=c, temperature=0.8, seed=3)):
        a, b = off.generate_text(ids, p), on.generate_text(ids, p)
        if p.temperature == 0:
            assert b.tokens == a.tokens
        assert b.finish_reason == "stop" and len(json.loads(b.text)["colors"]) == 6
    assert on.metrics().spec_accepted > 0
    check_clean(on)


def test_float32_path_every_draft_equals_plain(default_model, every_draft):
    """The float32 weights (OpenBLAS matmuls, the reference attention): verify rows give
    plain decoding's tokens too."""
    off = Engine(default_model, EngineConfig(kv_budget_bytes=64 << 20))
    on = Engine(default_model, EngineConfig(kv_budget_bytes=64 << 20, speculate="lookup"))
    ids = [copy_prompt(off)]
    assert run(on, ids, params(16)) == run(off, ids, params(16))
    assert on.metrics().spec_accepted > 0
    check_clean(on)
