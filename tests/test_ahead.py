"""A speculating engine's draft-free steps built before the read (`engine.ahead`): launched
when the plan turns out to be that step, dropped (and their writes undone) otherwise; greedy
tokens stay plain decoding's, and nothing leaks."""

from __future__ import annotations

import mlx.core as mx
import pytest
from test_speculative_engine import check_clean as check_released
from test_speculative_engine import copy_prompt

from engine import Engine, EngineConfig, SamplingParams, greedy
from engine.ahead import Ahead, stores

PROMPTS = ["Write a haiku about the sea.", "Give me a recipe for pancakes.",
           "Tell me about the moon and the tides."]
GEN = 32


def params(n=GEN):
    return SamplingParams(max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def plain(default_model_ext):
    engine = Engine(default_model_ext, EngineConfig(kv_budget_bytes=64 << 20))
    ids = [engine.encode_prompt(p) for p in PROMPTS] + [copy_prompt(engine)]
    return ids, [engine.generate_text(i, params()).tokens for i in ids]


def lookup(model, **kw) -> Engine:
    return Engine(model, EngineConfig(kv_budget_bytes=64 << 20, speculate="lookup", **kw))


def check_clean(engine: Engine):
    check_released(engine)  # every block back, no speculator state left
    assert engine.executor.ahead is None


def test_alone_steps_built_ahead_launch_and_drop_with_plain_tokens(default_model_ext, plain):
    ids, ref = plain
    engine = lookup(default_model_ext)
    assert [engine.generate_text(i, params()).tokens for i in ids] == ref
    m = engine.metrics()
    assert m.ahead_launched > GEN // 2, (m.ahead_launched, m.ahead_dropped)  # plain answers
    assert m.ahead_dropped > 0 and m.spec_accepted > 0  # the copying one drafts
    check_clean(engine)


def test_batched_and_cancelled_streams_keep_plain_tokens(default_model_ext, plain):
    ids, ref = plain
    engine = lookup(default_model_ext, max_running=8)
    handles = [engine.submit(i, params()) for i in ids]
    victim = engine.submit(ids[0], params(200))
    seen = 0
    for e in victim:  # the others step on while it runs, then go on without it
        seen += e.token is not None
        if seen == 10:
            engine.cancel(victim.request_id)
    got = [[e.token for e in h if e.token is not None] for h in handles]
    assert got == ref
    assert engine.metrics().ahead_launched > 0
    check_clean(engine)


def test_a_request_cancelled_in_flight_fails_no_other(default_model_ext, plain):
    """A request cancelled while its step runs unread: the step built next (without it:
    its blocks are gone) must not fail the others (`kvchat bench load`'s cancels did)."""
    ids, ref = plain
    engine = lookup(default_model_ext, max_running=8)
    handles = [engine.submit(i, params()) for i in ids[:3]]
    for _ in range(3 * GEN):
        if engine.executor.in_flight and engine.speculator.quiet:
            break
        engine.step()
    assert engine.executor.in_flight and engine.speculator.quiet
    handles[1].cancel()
    events = [list(handles[i]) for i in (0, 2)]
    assert not [e.error for ev in events for e in ev if e.error]
    assert [[e.token for e in ev if e.token is not None] for ev in events] == [ref[0], ref[2]]
    check_clean(engine)


def test_a_step_fed_an_unsure_token_is_dropped(default_model_ext, plain, monkeypatch):
    """Every pick declined (-1): a step built ahead was fed 0 for it, so it must not launch;
    the tokens are settled by mlx-lm's formula and the next step built again."""
    ids, ref = plain
    real = greedy.lazy

    def unsure(logits, *, fast):
        picked = real(logits, fast=fast)
        return mx.full(picked.shape, -1, dtype=picked.dtype) if fast else picked

    monkeypatch.setattr(greedy, "lazy", unsure)
    engine = lookup(default_model_ext)
    assert engine.generate_text(ids[0], params()).tokens == ref[0]
    m = engine.metrics()
    assert m.ahead_launched == 0 and m.ahead_dropped > 0
    check_clean(engine)


class Pool:
    """The stores a pool keeps, as `Ahead.undo` sees them."""

    def __init__(self):
        self.keys, self.values = [object(), object()], [object(), object()]

    arrays = property(lambda self: (self.keys, self.values))

    def restore(self, snap):
        self.keys[:], self.values[:] = snap


def built(pool: Pool) -> Ahead:
    """A step built on ``pool``: its stores replaced by new ones (its writes)."""
    snap = (list(pool.keys), list(pool.values))
    pool.keys[:], pool.values[:] = [object(), object()], [object(), object()]
    return Ahead([], [], mx.array([0]), mx.array([0.0]), snap, stores(pool))


def test_undo_puts_back_the_stores_before_the_writes():
    pool = Pool()
    before = stores(pool)
    step = built(pool)
    step.undo(pool)
    assert all(a is b for a, b in zip(stores(pool), before, strict=True))
    assert step.snap is None


def test_undo_keeps_writes_made_on_top_of_the_step():
    """A context shift wrote on top of the step's stores: putting the old ones back would
    lose the shift, so the step's writes stay (its own next slot, written again later)."""
    pool = Pool()
    step = built(pool)
    pool.keys[0] = shifted = object()
    step.undo(pool)
    assert pool.keys[0] is shifted and step.snap is None
