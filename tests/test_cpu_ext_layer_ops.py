"""The extension's two-op layers (`cpu_ext.layer_ops`): the runner's logits and K/V
pools bit-identical to the separate ops they replace, on every kind of step."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine import Engine, EngineConfig
from engine.executor import build_batch
from engine.model.packed_batch import pack


@pytest.fixture(scope="module")
def engines(default_model_ext):
    """Two engines on the same weights: the two-op layers, and the separate ops."""
    cfg = EngineConfig(kv_budget_bytes=64 << 20, prefix_cache=False)
    fused, separate = Engine(default_model_ext, cfg), Engine(default_model_ext, cfg)
    assert all(x is not None for x in fused.runner.ext), "the default model takes two ops"
    separate.runner.ext = [None] * len(separate.runner.ext)
    yield fused, separate
    fused.shutdown()
    separate.shutdown()


def same(a: mx.array | None, b: mx.array | None) -> None:
    np.testing.assert_array_equal(np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32)))


def step(eng: Engine, sids: list[int], tokens: list[list[int]]) -> mx.array:
    plans = [eng.blocks.append(s, len(t)) for s, t in zip(sids, tokens, strict=True)]
    batch = build_batch(eng.blocks, sids, mx.array(tokens, dtype=mx.int32),
                        [p.slots for p in plans])
    logits = eng.runner(batch, eng.kv)
    mx.eval(logits, eng.kv.keys, eng.kv.values)
    return logits


def packed_step(eng: Engine, prefill: tuple[int, list[int]], decodes: list[tuple[int, int]]):
    sid, tokens = prefill
    plan = eng.blocks.append(sid, len(tokens))
    pre = [(tokens, list(plan.slots), eng.blocks.block_tables[sid],
            eng.blocks.num_tokens[sid])]
    dec = []
    for s, tok in decodes:
        p = eng.blocks.append(s, 1)
        dec.append((tok, p.slots[0], eng.blocks.block_tables[s], eng.blocks.num_tokens[s]))
    logits = eng.runner.forward_packed(pack(pre, dec), eng.kv)
    mx.eval(logits, eng.kv.keys, eng.kv.values)
    return logits


def test_every_kind_of_step_is_bit_identical(engines):
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(100, 40000, size=70)]
    other = [int(t) for t in rng.integers(100, 40000, size=23)]
    outs = []
    for eng in engines:
        for sid in (1, 2, 3):
            eng.blocks.allocate(sid)
        got = [step(eng, [1], [prompt])]  # a prefill chunk (B 1, L 70)
        got += [step(eng, [1], [[prompt[i]]]) for i in range(3)]  # decodes at 70..72
        got.append(step(eng, [2], [other]))
        got.append(step(eng, [1, 2], [[5], [7]]))  # a ragged batch (B 2, L 1)
        got.append(packed_step(eng, (3, prompt[:17]), [(1, 9), (2, 11)]))  # mixed step
        got.append(step(eng, [3], [[13]]))
        k = [np.array(x.astype(mx.float32)) for x in eng.kv.keys]
        v = [np.array(x.astype(mx.float32)) for x in eng.kv.values]
        for sid in (1, 2, 3):
            eng.blocks.free(sid)
        outs.append((got, k, v))
    (a, ka, va), (b, kb, vb) = outs
    for x, y in zip(a, b, strict=True):
        same(x, y)
    for x, y in zip(ka + va, kb + vb, strict=True):
        np.testing.assert_array_equal(x, y)


def test_a_layer_of_another_kind_keeps_the_separate_ops(default_model_ext):
    from engine.model.cpu_ext import layer_ops

    eng = Engine(default_model_ext, EngineConfig(kv_budget_bytes=16 << 20))
    try:
        layer, fused = eng.runner.layers[0], eng.runner.fused[0]
        assert layer_ops.plan(layer, fused, 9, 3) is not None
        assert layer_ops.plan(layer, None, 9, 3) is None  # not fused
        norm = layer.input_layernorm
        layer.input_layernorm = layer.post_attention_layernorm.__class__.__bases__[0](576)
        try:  # a plain nn.RMSNorm (not the extension's): MLX's op, so not this path
            assert layer_ops.plan(layer, fused, 9, 3) is None
        finally:
            layer.input_layernorm = norm
    finally:
        eng.shutdown()


def test_bad_arguments_are_refused(default_model_ext, engines):
    ext = engines[0].runner.ext[0]
    with pytest.raises(ValueError, match="layer_tail"):
        ext.tail(mx.zeros((1, 2, 576)), mx.zeros((1, 9, 1, 64)))  # 1 attention row for 2
    with pytest.raises(ValueError, match="layer_head"):
        ext.head(mx.zeros((1, 2, 100)), 0)  # not the hidden size


def test_llama3_scaled_rope_runs_on_the_extension(default_model, tmp_path):
    """Llama 3.x's scaled RoPE (mlx-lm's `Llama3RoPE`, its frequencies given to the op)
    is the extension's too: close to mx.fast.rope, and the layer takes the two ops."""
    from arch_zoo import build
    from mlx_lm.models.rope_utils import Llama3RoPE
    from test_engine_parity import mlx_lm_greedy

    from engine import SamplingParams, load_model
    from engine.model.cpu_ext.linear import rebind
    from engine.model.cpu_ext.norm_rope import CpuLlama3RoPE

    ref = Llama3RoPE(64, 131072, False, 500000.0, {
        "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192, "rope_type": "llama3"})
    ours = rebind(CpuLlama3RoPE, ref)
    x = mx.random.normal((2, 4, 5, 64))
    for offset in (0, 1000, mx.array([70000, 3], dtype=mx.int32)):
        err = mx.abs(ours(x, offset=offset) - ref(x, offset=offset)).max().item()
        assert err < 1e-5, (offset, err)  # float32 rounding of the same angles
    build(tmp_path / "l3", "llama3", default_model.path, eos=[0], bits=4, seed=6)
    loaded = load_model(str(tmp_path / "l3"))
    eng = Engine(loaded, EngineConfig(kv_budget_bytes=16 << 20))
    try:
        assert type(eng.runner.layers[0].self_attn.rope) is CpuLlama3RoPE
        assert all(x is not None for x in eng.runner.ext)
        ids = [int(t) for t in np.random.default_rng(3).integers(3, 500, 40)]
        got = eng.generate_text(ids, SamplingParams(max_tokens=16, ignore_eos=True)).tokens
        assert got == mlx_lm_greedy(loaded.model, ids, 16, 64, set())
    finally:
        eng.shutdown()
