"""The step's layers built in C++ (`cpu_ext.layer_stack`): the same logits and pools to the
bit as the runner's layer-by-layer build, for every KV format it builds, and used only
where that build would launch the same attention kernel."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from test_cpu_ext_layer_ops import step as layer_ops_step

from engine import Engine, EngineConfig, SamplingParams
from engine.model.attention.guard import GUARD
from engine.model.cpu_ext import layer_stack


@pytest.fixture
def stack_calls(monkeypatch):
    """How many times `LayerStack.run` built a step's layers."""
    calls = []
    run = layer_stack.LayerStack.run

    def counted(self, *args, **kwargs):
        calls.append(self.block_size)
        return run(self, *args, **kwargs)

    monkeypatch.setattr(layer_stack.LayerStack, "run", counted)
    return calls


def step(eng: Engine, sids: list[int], tokens: list[list[int]]) -> np.ndarray:
    """One `eng.runner` step of these sequences' tokens (`test_cpu_ext_layer_ops.step`)."""
    return np.array(layer_ops_step(eng, sids, tokens).astype(mx.float32))


def pool_arrays(eng: Engine) -> list[np.ndarray]:
    """Every stored array of the pool (a quantized side's parts, residual rows too)."""
    stores = eng.kv.keys + eng.kv.values + getattr(eng.kv, "res_keys", []) + getattr(
        eng.kv, "res_values", [])
    return [np.array(a.astype(mx.float32)) for x in stores
            for a in (x if isinstance(x, tuple) else (x,))]


def both_ways(model, monkeypatch, stack_calls, cfg: EngineConfig, steps, min_used: int):
    """``steps(engine)`` with the stack and without, each on a fresh engine: the same bits,
    and the stack used at least ``min_used`` times (never when it is off)."""
    outs = []
    for flag in ("1", "0"):
        monkeypatch.setenv("KVCHAT_LAYER_STACK", flag)
        eng = Engine(model, cfg)
        try:
            assert eng.runner.stack_layers
            before = len(stack_calls)
            outs.append(steps(eng))
            used = len(stack_calls) - before
        finally:
            eng.shutdown()
        assert (used >= min_used) if flag == "1" else used == 0
    (a, ka), (b, kb) = outs
    for x, y in zip(a + ka, b + kb, strict=True):
        np.testing.assert_array_equal(x, y)


def run_steps(eng: Engine) -> tuple[list, list]:
    rng = np.random.default_rng(1)
    prompt = [int(t) for t in rng.integers(100, 40000, size=37)]
    for sid in (1, 2):
        eng.blocks.allocate(sid)
    got = [step(eng, [1], [prompt])]  # a prefill (B 1, L 37)
    got += [step(eng, [1], [[prompt[i]]]) for i in range(4)]  # decodes, one crossing a block
    got.append(step(eng, [2], [prompt[:5]]))
    got += [step(eng, [1, 2], [[5], [7]]) for _ in range(2)]  # a ragged batch (B 2, L 1)
    pools = pool_arrays(eng)
    for sid in (1, 2):
        eng.blocks.free(sid)
    return got, pools


FORMATS = {
    "f16": {},
    "q8 per token, rotated": dict(kv_bits=8),
    "k8v4 per token, not rotated": dict(k_bits=8, v_bits=4, kv_rotation=False),
    "q4-kivi": dict(kv_bits=4, kv_residual=True, kv_key_channel=True),
    "k8v4-kivi, not rotated": dict(k_bits=8, v_bits=4, kv_residual=True, kv_key_channel=True,
                                   kv_rotation=False),
}


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=FORMATS.keys())
def test_the_stack_gives_the_layer_by_layer_bits(default_model_ext, monkeypatch, stack_calls,
                                                 fmt):
    # every step after the variant's first launch (already validated by other tests, or by
    # this run's first step of each kind) goes through the stack; a residual pool's steps
    # that fill a block (one here) and its prefills do not
    cfg = EngineConfig(kv_budget_bytes=32 << 20, prefix_cache=False, **fmt)
    both_ways(default_model_ext, monkeypatch, stack_calls, cfg, run_steps, 5)


def verify_steps(eng: Engine) -> tuple[list, list]:
    """Packed steps of decode rows only: one sequence verifying three drafts (its newest
    positions, consecutive), next to another sequence's single decode."""
    from engine.model.packed_batch import pack

    rng = np.random.default_rng(2)
    for sid in (1, 2):
        eng.blocks.allocate(sid)
        step(eng, [sid], [[int(t) for t in rng.integers(100, 40000, size=14 + 9 * sid)]])
    got = []
    for r in range(3):
        rows = []
        for sid, k in ((1, 4), (2, 1)):
            for j in range(k):
                p = eng.blocks.append(sid, 1)
                rows.append((100 + 7 * r + j, p.slots[0], eng.blocks.block_tables[sid],
                             eng.blocks.num_tokens[sid]))
        logits = eng.runner.forward_packed(pack([], rows), eng.kv)
        mx.eval(logits, eng.kv.keys, eng.kv.values)
        got.append(np.array(logits.astype(mx.float32)))
    pools = pool_arrays(eng)
    for sid in (1, 2):
        eng.blocks.free(sid)
    return got, pools


@pytest.mark.parametrize("fmt", [FORMATS["f16"], FORMATS["q4-kivi"]], ids=["f16", "q4-kivi"])
def test_a_packed_step_of_decode_rows_gives_the_same_bits(default_model_ext, monkeypatch,
                                                          stack_calls, fmt):
    cfg = EngineConfig(kv_budget_bytes=32 << 20, prefix_cache=False, **fmt)
    both_ways(default_model_ext, monkeypatch, stack_calls, cfg, verify_steps, 2)


def test_generation_is_token_for_token_the_same(default_model_ext, monkeypatch, stack_calls):
    cfg = EngineConfig(kv_budget_bytes=32 << 20, prefix_cache=False)
    eng = Engine(default_model_ext, cfg)
    try:
        ids = eng.tokenizer.encode("The history of the printing press begins")
        params = SamplingParams(max_tokens=40, ignore_eos=True)
        monkeypatch.setenv("KVCHAT_LAYER_STACK", "0")
        plain = eng.generate_text(ids, params).tokens
        assert not stack_calls
        monkeypatch.setenv("KVCHAT_LAYER_STACK", "1")
        assert eng.generate_text(ids, params).tokens == plain
        assert len(stack_calls) >= 39  # the decodes; the prompt's chunk can be interrupted
        assert eng.blocks.num_free_blocks == eng.blocks.num_blocks
    finally:
        eng.shutdown()


def test_the_guard_checks_layer_0_and_a_tripped_guard_stops_the_stack(default_model_ext,
                                                                      stack_calls):
    """A variant's first launch is built layer by layer, so the guard checks layer 0's
    against the reference before the stack builds any step with the same kernel; once the
    guard has tripped, no step takes the stack (every layer falls to the reference)."""
    eng = Engine(default_model_ext, EngineConfig(kv_budget_bytes=32 << 20, prefix_cache=False))
    try:
        GUARD.reset()
        eng.blocks.allocate(1)
        step(eng, [1], [[11]])
        assert not stack_calls and GUARD._validated
        step(eng, [1], [[12]])
        assert len(stack_calls) == 1
        GUARD.switch.trip("a test")
        step(eng, [1], [[13]])
        assert len(stack_calls) == 1
    finally:
        GUARD.reset()
        eng.shutdown()


@pytest.mark.parametrize("config", [dict(kv_bits=4, kv_residual=True), dict(kernels=False)],
                         ids=["residual, keys per token", "kernels off"])
def test_other_pools_and_paths_keep_the_layer_by_layer_build(default_model_ext, stack_calls,
                                                              config):
    eng = Engine(default_model_ext,
                 EngineConfig(kv_budget_bytes=32 << 20, prefix_cache=False, **config))
    try:
        ids = eng.tokenizer.encode("Once upon a time")
        assert len(eng.generate_text(ids, SamplingParams(max_tokens=6)).tokens) > 0
        assert not stack_calls
    finally:
        eng.shutdown()


def test_bad_pools_are_refused(default_model_ext):
    eng = Engine(default_model_ext, EngineConfig(kv_budget_bytes=16 << 20, prefix_cache=False))
    try:
        stack = layer_stack.LayerStack(eng.runner.ext, eng.runner.attention, 16)
        h = mx.zeros((1, 1, 576))
        one = mx.array([0], dtype=mx.int32)
        keys, values = [[k] for k in eng.kv.keys[1:]], [[v] for v in eng.kv.values[1:]]
        with pytest.raises(ValueError, match="one key and one value pool per layer"):
            stack.run(h, keys[:3], values, 1, one, one[None], one + 1, one)
        bad = [[mx.zeros((3, 17, 64), mx.float16)]] * len(keys)  # not whole blocks
        with pytest.raises(ValueError, match="stores must be"):
            stack.run(h, bad, bad, 1, one, one[None], one + 1, one)
        with pytest.raises(ValueError, match="as its kind stores them"):  # 1 array, not 3
            stack.run(h, keys, values, 1, one, one[None], one + 1, one, kind=1, k_bits=8,
                      k_group=64, v_bits=8, v_group=64)
        with pytest.raises(ValueError, match="residual pools need their map"):
            stack.run(h, keys, values, 1, one, one[None], one + 1, one, kind=2)
    finally:
        eng.shutdown()
