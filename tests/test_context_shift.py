"""Context shift end to end (`engine.shifting`): a generation runs to 3x its context within
a bounded number of blocks, gives every block back whenever it is cancelled, never serves a
re-rotated block under its old prefix key, and is opt-in (without it nothing changes)."""

from __future__ import annotations

import pytest

from engine import Engine, EngineConfig, SamplingParams, load_model
from engine.errors import KVChatError, RequestError

CONTEXT, BS = 128, 16


def _params(n: int, shift: bool | None = True, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True, context_shift=shift, **kw)


def _idle(engine: Engine) -> None:
    """Nothing held: every block free or cached, the bookkeeping consistent."""
    b = engine.blocks
    b.check_invariants()
    assert b.num_used_blocks == 0 and not b.block_tables
    assert len(b.free_block_ids) + b.num_cached_blocks == b.num_blocks


@pytest.fixture(scope="module")
def engine(quick_model):
    return Engine(quick_model, EngineConfig(kv_budget_bytes=32 << 20, block_size=BS,
                                            max_context=CONTEXT))


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return Engine(tiny_model, EngineConfig(kv_budget_bytes=8 << 20, block_size=8,
                                           max_context=64))


def test_three_contexts_run_to_max_tokens_in_bounded_blocks(engine):
    ids = engine.tokenizer.encode("Tell me a long story about a lighthouse keeper.")
    r = engine.generate_text(ids, _params(3 * CONTEXT))
    s = r.stats
    assert r.finish_reason == "length" and len(r.tokens) == 3 * CONTEXT and r.error is None
    # each shift drops half of the 7 blocks after the sink block (3 of 16 tokens)
    assert s.context_shifts >= 5 and s.shifted_tokens == s.context_shifts * 3 * BS
    assert len(ids) + len(r.tokens) - s.shifted_tokens <= CONTEXT  # what the cache held
    assert s.blocks_used <= CONTEXT // BS  # window plus sinks, never more
    assert engine.recorder.peak_blocks <= CONTEXT // BS
    _idle(engine)
    # without the shift the same request stops at the context, as before (and its tokens
    # up to there are the same: nothing shifts before the context is full)
    plain = engine.submit(ids, _params(3 * CONTEXT, shift=False))
    assert plain.max_tokens == CONTEXT - len(ids) and "reduced" in plain.notice
    tokens = [e.token for e in plain if e.token is not None]
    assert tokens == r.tokens[:CONTEXT - len(ids)]
    _idle(engine)


def test_cancel_at_any_point_gives_every_block_back(tiny):
    ids = list(range(100, 140))  # 40 tokens: 5 blocks of 8, the context holds 64
    for stop_after in (3, 23, 24, 25, 60, 131):  # before, at and after shifts
        handle, got = tiny.submit(ids, _params(400)), 0
        for event in handle:
            got += event.token is not None
            if got == stop_after:
                handle.cancel()
        assert event.finish_reason == "cancelled" and got >= stop_after
        _idle(tiny)
    # two sharing a prompt: one is cancelled mid-shift, the other runs on
    a, b = tiny.submit(ids, _params(200)), tiny.submit(ids, _params(150))
    got = 0
    for event in b:
        got += event.token is not None
        if got == 70:
            a.cancel()
    assert got == 150
    assert [e.finish_reason for e in a][-1] == "cancelled"
    _idle(tiny)


def test_shifted_blocks_are_not_served_under_their_old_keys(tiny, tiny_model):
    ids = list(range(300, 340))  # 5 full prompt blocks, new to this engine
    fresh = Engine(tiny_model, EngineConfig(kv_budget_bytes=8 << 20, block_size=8,
                                            max_context=64))
    before = fresh.generate_text(ids, _params(12, shift=False)).tokens
    shifted = tiny.generate_text(ids, _params(100))
    assert shifted.stats.context_shifts >= 1
    # its first shift dropped prompt blocks 1-3 (unchanged: still cached under their keys)
    # and moved block 4 (re-rotated: its key must be gone)
    seq = tiny.prefix.new_sequence("local", 0)
    assert len(tiny.prefix.ram_hits(seq, ids + [0])) == 4
    after = tiny.generate_text(ids, _params(12, shift=False))
    assert after.stats.cached_tokens == 4 * 8 and after.tokens == before
    _idle(tiny)


def test_speculation_leaves_greedy_output_unchanged(tiny_model, monkeypatch):
    from engine.speculation import Speculator

    # verify every lookup candidate (not only those measured to pay off)
    monkeypatch.setattr(Speculator, "_allot", lambda self, cands, *_: dict(cands))
    ids = list(range(500, 530)) * 2
    runs, proposed = [], []
    for mode in ("off", "lookup", "draft:given"):  # the draft model: the model itself
        e = Engine(tiny_model, EngineConfig(kv_budget_bytes=8 << 20, block_size=8,
                                            max_context=96, speculate=mode), draft=tiny_model)
        e.speculator.config.fixed = 2 if mode.startswith("draft") else None
        r = e.generate_text(ids, _params(200))
        assert r.finish_reason == "length" and r.stats.context_shifts >= 2
        runs.append(r.tokens)
        proposed.append(r.stats.spec_proposed)
        _idle(e)
    assert runs[0] == runs[1] == runs[2]
    assert proposed[0] == 0 and proposed[1] > 0 and proposed[2] > 0  # drafts were verified


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_shifted_sequence_survives_preemption(tiny, tiny_model, mode):
    # a pool of 12 blocks: an interactive request takes blocks from the shifted background one
    e = Engine(tiny_model, EngineConfig(kv_budget_bytes=12 * tiny.layout.bytes_per_block,
                                        block_size=8, max_context=64, preempt_mode=mode))
    assert e.blocks.num_blocks == 12
    ids = list(range(100, 140))
    alone = e.generate_text(ids, _params(160)).tokens
    long = e.submit(ids, _params(160), priority=1)
    tokens, final = [], None
    for event in long:
        if event.token is not None:
            tokens.append(event.token)
        final = event
        if len(tokens) == 60:  # shifted once; 8 blocks of the 12 go to the newcomer
            assert e.generate_text(list(range(700, 760)), _params(4, shift=False),
                                   priority=0).finish_reason == "length"
    assert final.finish_reason == "length" and len(tokens) == 160
    assert final.stats.preemptions >= 1 and final.stats.context_shifts >= 2
    if mode == "swap":  # the exact bytes come back: the same tokens as alone
        assert tokens == alone
    _idle(e)


def test_models_that_cannot_shift_refuse_in_one_line(tmp_path, default_model):
    from arch_zoo import build

    path = build(tmp_path / "smollm3", "smollm3", default_model.path, eos=2, seed=7)
    loaded = load_model(str(path), weights="float32")
    e = Engine(loaded, EngineConfig(kv_budget_bytes=8 << 20, max_context=64))
    with pytest.raises(RequestError, match="plain RoPE") as err:
        e.submit([5, 6, 7], _params(10))
    assert "\n" not in str(err.value)
    assert e.generate_text([5, 6, 7], _params(4, shift=None)).finish_reason == "length"
    with pytest.raises(KVChatError, match="NoPE"):  # --context-shift: refused at start
        Engine(loaded, EngineConfig(kv_budget_bytes=8 << 20, context_shift=True))


def test_a_quantized_pool_shifts_too(quick_model):
    # K and V at 8 bits (rotated before quantizing): the moved keys are dequantized,
    # rotated back, shifted and quantized again
    e = Engine(quick_model, EngineConfig(kv_budget_bytes=32 << 20, block_size=BS,
                                         max_context=CONTEXT, kv_bits=8))
    assert e.layout.k_quant is not None and e.layout.k_quant.rotation
    ids = e.tokenizer.encode("Tell me a long story about a lighthouse keeper.")
    r = e.generate_text(ids, _params(2 * CONTEXT))
    assert r.finish_reason == "length" and len(r.tokens) == 2 * CONTEXT
    assert r.stats.context_shifts >= 2 and r.stats.blocks_used <= CONTEXT // BS
    plain = e.generate_text(ids, _params(CONTEXT - len(ids), shift=False)).tokens
    assert r.tokens[:len(plain)] == plain  # the same until the context is full
    _idle(e)


def test_a_residual_pool_shifts_too(quick_model):
    # q4-kivi: full blocks (per-channel 4-bit keys) move re-quantized, the filling block's
    # exact rows move in place; the same tokens until the context is full, 0 leaks
    e = Engine(quick_model, EngineConfig(kv_budget_bytes=32 << 20, block_size=BS,
                                         max_context=CONTEXT, kv_bits=4, kv_residual=True,
                                         kv_key_channel=True))
    assert e.layout.residual and e.layout.key_channel
    ids = e.tokenizer.encode("Tell me a long story about a lighthouse keeper.")
    r = e.generate_text(ids, _params(2 * CONTEXT))
    assert r.finish_reason == "length" and len(r.tokens) == 2 * CONTEXT
    assert r.stats.context_shifts >= 2 and r.stats.blocks_used <= CONTEXT // BS
    plain = e.generate_text(ids, _params(CONTEXT - len(ids), shift=False)).tokens
    assert r.tokens[:len(plain)] == plain
    _idle(e)
    e.kv.reclaim()
    assert e.kv.num_residual_blocks == 0


def test_a_refused_setup_refuses_at_start_when_shifting_is_the_default(tiny):
    from engine.shifting import ContextShifter

    reason = "context shift does not run across ranks (--distributed)"
    off = ContextShifter(tiny.runner, tiny.kv, tiny.blocks, 64)
    off.refuse(reason)
    assert off.wants(None) is False and off.wants(False) is False
    with pytest.raises(RequestError, match="across ranks"):
        off.wants(True)
    on = ContextShifter(tiny.runner, tiny.kv, tiny.blocks, 64, default=True)
    assert on.wants(None) is True
    with pytest.raises(KVChatError, match="across ranks"):
        on.refuse(reason)


def test_pipelined_decoding_shifts_the_same(tiny_model):
    # decode steps launched ahead (the GPU default): a shift planned while a step is in flight
    ids = list(range(900, 940))
    runs = []
    for pipeline in (False, True):
        e = Engine(tiny_model, EngineConfig(kv_budget_bytes=8 << 20, block_size=8,
                                            max_context=64, pipeline=pipeline))
        r = e.generate_text(ids, _params(150))
        assert r.finish_reason == "length" and r.stats.context_shifts >= 3
        runs.append(r.tokens)
        _idle(e)
    assert runs[0] == runs[1]
