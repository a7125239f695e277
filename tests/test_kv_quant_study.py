"""The fake-quantization harness of `scripts/kv_quant_study.py` (the study behind the README's
"KV quantization schemes, studied" table): its quantizers and its attention must be what
they claim, or the table compares the wrong things."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from engine.kvcache.kv_cache import _quantize
from engine.kvcache.quant import QuantSpec

_PATH = Path(__file__).resolve().parents[1] / "scripts" / "kv_quant_study.py"


@pytest.fixture(scope="module")
def study():
    spec = importlib.util.spec_from_file_location("kv_quant_study", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("bits", [4, 8])
def test_affine_is_the_pools_quantization(study, bits):
    rows = mx.random.normal((3, 40, 64), key=mx.random.key(bits)) * 3
    data, scales, biases = _quantize(rows, QuantSpec(bits, 64))
    pool = mx.dequantize(data, scales.astype(mx.float32), biases.astype(mx.float32),
                         group_size=64, bits=bits)
    assert mx.array_equal(study.mlx_affine(rows, bits, 64), pool).item()


@pytest.mark.parametrize("bits", [4, 8])
def test_symmetric_uses_the_largest_magnitude_as_its_lowest_level(study, bits):
    x = mx.random.normal((50, 32), key=mx.random.key(7)) * 5
    y = study.symmetric(x, bits)
    half = 1 << (bits - 1)
    xs, ys = np.array(x), np.array(y)
    idx = np.abs(xs).argmax(-1)
    m = xs[np.arange(50), idx]
    d = (m / -half).astype(np.float16).astype(np.float32)
    np.testing.assert_allclose(ys[np.arange(50), idx], -half * d, rtol=1e-6)
    err, step = np.abs(xs - ys), np.abs(d)[:, None] * (1 + 1e-5)
    levels = np.round(ys / d[:, None]) + half
    assert levels.min() >= 0 and levels.max() <= 2 * half - 1
    inner = (levels > 0) & (levels < 2 * half - 1)
    assert (err <= step / 2)[inner].all()
    # the top level is one short of the largest magnitude's mirror: clipped within a step
    assert (err <= step).all()
    assert len(np.unique(levels)) > half  # it spends its levels, not a degenerate grid


def test_per_channel_groups_run_along_a_blocks_tokens(study):
    # channel 0: a large offset that hardly moves within a block; the rest small
    base = np.random.default_rng(0).normal(size=(1, 1, 48, 64)).astype(np.float32)
    base[..., 0] = 100 + 0.01 * base[..., 0]
    k = mx.array(base)
    chan = np.array(study.per_channel(study.affine, k, 4))
    token = np.array(study.per_token(study.affine, k, 4, 64))
    err_chan, err_token = np.abs(chan - base), np.abs(token - base)
    assert err_chan[..., 1:].mean() < err_token[..., 1:].mean() / 5
    assert err_chan[..., 0].max() < 0.05  # the offset channel keeps its fine movement
    # a channel's group is one block: tokens of another block never change it
    moved = base.copy()
    moved[:, :, 16:, 5] *= 50
    again = np.array(study.per_channel(study.affine, mx.array(moved), 4))
    np.testing.assert_array_equal(again[:, :, :16], chan[:, :, :16])


def _reference(q, k, v, scale):
    L = q.shape[2]
    mask = mx.where(mx.arange(L)[None] <= mx.arange(L)[:, None], 0.0, -mx.inf)
    kv_heads = k.shape[1]
    rep = q.shape[1] // kv_heads
    k, v = (mx.repeat(a, rep, axis=1) for a in (k, v))
    return mx.softmax((q * scale) @ k.swapaxes(-1, -2) + mask, axis=-1) @ v


def _qkv(L):
    keys = [mx.random.key(i) for i in range(3)]
    return (mx.random.normal((1, 6, L, 64), key=keys[0]),
            mx.random.normal((1, 2, L, 64), key=keys[1]) * 4,
            mx.random.normal((1, 2, L, 64), key=keys[2]))


def test_attention_without_a_scheme_is_float16_attention(study):
    q, k, v = _qkv(40)
    study.Scheme.current = None
    out = study.attention(q, k, v, scale=0.125)
    want = _reference(q, study._f16(k), study._f16(v), 0.125)
    np.testing.assert_allclose(np.array(out), np.array(want), atol=2e-5)


def test_residual_and_sink_keys_are_the_float16_ones(study):
    side = {"bits": 4, "kind": "mlx", "group": 64, "rot": True}
    q, k, v = _qkv(40)
    want = np.array(_reference(q, study._f16(k), study._f16(v), 0.125))
    study.Scheme.current = {"k": side, "v": side, "resid": True, "sink": True}
    exact = np.array(study.attention(q, k, v, scale=0.125))
    study.Scheme.current = {"k": side, "v": side}
    quantized = np.array(study.attention(q, k, v, scale=0.125))
    study.Scheme.current = None
    # queries of blocks 0 and 1 see only the sink block and their own: all float16
    np.testing.assert_allclose(exact[:, :, :32], want[:, :, :32], atol=2e-5)
    assert np.abs(quantized[:, :, :32] - want[:, :, :32]).max() > 1e-2
    # block 2's queries also see block 1, quantized
    assert np.abs(exact[:, :, 32:] - want[:, :, 32:]).max() > 1e-3


def test_appended_blocks_drift_only_when_a_row_widens_the_range(study):
    rng = np.random.default_rng(3)
    x = rng.normal(size=(1, 2, 32, 64)).astype(np.float32)
    # block 0: its first two rows hold every channel's min and max, so no later row widens
    # a range and re-quantizing the rows already on the grid changes nothing
    x[:, :, 0], x[:, :, 1] = -5.0, 5.0
    appended = np.array(study.per_channel_appended(mx.array(x), 4))
    whole = np.array(study.per_channel(study.affine, mx.array(x), 4))
    np.testing.assert_allclose(appended[:, :, :16], whole[:, :, :16], atol=1e-6)
    # block 1's ranges grow as rows come: its early rows are rounded again, never better
    early = slice(16, 20)
    err_appended = np.abs(appended[:, :, early] - x[:, :, early]).mean()
    err_whole = np.abs(whole[:, :, early] - x[:, :, early]).mean()
    assert err_appended > err_whole
