"""The tiled matmul with int8 activations (`ops.set_activation_bits(8)`,
csrc/qmm_tiled_int8.cpp): exactly the formula it promises (x quantized to int8 per group,
exact integer dot products, then scale and bias), bit for bit the same row alone or in any
batch (the rows and the lanes kernels agree), and about llama.cpp's Q8_0 precision."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiled_oracle import promised, quantized

from engine.model.cpu_ext import build, linear, ops


@pytest.fixture(scope="module")
def int8():
    if not build.available():
        pytest.skip(f"CPU extension unavailable: {build.unavailable_reason()}")
    if not ops.tiled_supported():
        pytest.skip("this CPU has no AVX-512 VNNI: the tiled matmul is not built")
    ops.set_activation_bits(8)
    yield
    ops.set_activation_bits(16)


@pytest.mark.parametrize("bits", [4, 5, 6, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("M,N,K", [(1, 16, 128), (5, 96, 256), (33, 48, 512), (70, 160, 384)])
def test_int8_qmm_computes_what_it_promises(int8, bits, group, M, N, K):
    w, s, b = quantized(N, K, group, seed=M + N, bits=bits)
    x = mx.random.normal((M, K))
    x = x.at[0, 5].add(80.0)  # an outlier: int8 loses the rest of its group's precision
    out = ops.qmm(x, *ops.tile(w, s, b, group, bits), group_size=group, bits=bits, tiled=True)
    exp = promised(x, w, s, b, group, bits, levels=127)
    assert out.shape == (M, N) and out.dtype == mx.float32
    np.testing.assert_allclose(np.array(out), exp, rtol=0, atol=2e-6 * np.abs(exp).max())
    ref = mx.quantized_matmul(x, w, s, b, transpose=True, group_size=group, bits=bits)
    err = (mx.abs(out - ref).max() / mx.abs(ref).max()).item()
    assert 1e-4 < err < 0.15, err  # int8: coarse where an outlier sets the group step


@settings(max_examples=15, deadline=None)
@given(rows=st.integers(1, 40), split=st.integers(1, 39), bits=st.sampled_from([4, 8]))
def test_int8_rows_do_not_depend_on_the_batch(int8, rows, split, bits):
    """A row's result is the same alone or in any batch: the rows kernel (few x rows) and
    the lanes kernel (from ~14) give the same bits."""
    w, s, b = ops.tile(*quantized(64, 256, 32, seed=3, bits=bits), 32, bits)
    x = mx.random.normal((rows, 256), key=mx.random.key(rows))
    whole = ops.qmm(x, w, s, b, group_size=32, bits=bits, tiled=True)
    k = min(split, rows)
    parts = [ops.qmm(x[:k], w, s, b, group_size=32, bits=bits, tiled=True)]
    if k < rows:
        parts.append(ops.qmm(x[k:], w, s, b, group_size=32, bits=bits, tiled=True))
    assert mx.array_equal(whole, mx.concatenate(parts)).item()


def test_the_setting_switches_precision_and_refuses_other_widths(int8):
    w, s, b = ops.tile(*quantized(32, 256, 32, seed=2), 32, 4)
    x = mx.random.normal((20, 256))
    eight = ops.qmm(x, w, s, b, group_size=32, bits=4, tiled=True)
    mx.eval(eight)  # the setting is read when a product runs, not when it is built
    ops.set_activation_bits(16)
    try:
        sixteen = ops.qmm(x, w, s, b, group_size=32, bits=4, tiled=True)
        mx.eval(sixteen)
        assert ops.activation_bits() == 16
    finally:
        ops.set_activation_bits(8)
    assert not mx.array_equal(eight, sixteen).item()
    assert mx.allclose(eight, sixteen, rtol=0, atol=0.05 * mx.abs(sixteen).max().item()).item()
    with pytest.raises(ValueError, match="8 or 16"):
        ops.set_activation_bits(4)
    assert ops.activation_bits() == 8


def test_int8_nan_input_gives_nan_rows_only(int8):
    w, s, b = ops.tile(*quantized(32, 64, 32, seed=1), 32, 4)
    for rows in (3, 20):
        x = mx.random.normal((rows, 64)).at[1, 7].add(mx.array(float("nan")))
        out = np.array(ops.qmm(x, w, s, b, group_size=32, bits=4, tiled=True))
        assert np.isnan(out[1]).all() and np.isfinite(np.delete(out, 1, axis=0)).all()


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("M", [1, 5, 40])  # the rows kernel, then the lanes kernel
def test_a_symmetric_format_takes_the_integer_bias(int8, bits, M):
    """Q4_0/Q8_0 (biases = -2^(bits-1) x scales, one (1, 1) factor): llama.cpp's form,
    sum over g of s * dx * (isum + factor * the int8 sum of x)."""
    import mlx.nn as nn

    N, K, group = 48, 256, 32
    w, s, _ = quantized(N, K, group, seed=bits, bits=bits)
    factor = -(2 ** (bits - 1))
    layer = nn.QuantizedLinear(K, N, bias=False, group_size=group, bits=bits)
    layer.update({"weight": w, "scales": s, "biases": s * factor})
    sym = linear.CpuTiledLinear.from_quantized(layer)
    assert sym["biases"].shape == (1, 1)
    x = mx.random.normal((M, K), key=mx.random.key(M))
    out = np.array(sym(x)).astype(np.float64)
    codes = np.array(mx.dequantize(w, mx.ones_like(s), mx.zeros_like(s), group_size=group,
                                   bits=bits)).astype(np.float64).reshape(N, K // group, group)
    xg = np.array(x).reshape(M, K // group, group)
    amax = np.abs(xg).max(-1, keepdims=True)
    qx = np.round(xg * (np.float32(127) / amax)).astype(np.float64)
    dx = (amax / np.float32(127)).astype(np.float32).astype(np.float64)[..., 0]
    isum = np.einsum("mgk,ngk->mng", qx, codes) + factor * qx.sum(-1)[:, None]
    exp = (isum * np.array(s.astype(mx.float32)).astype(np.float64)[None] * dx[:, None]).sum(-1)
    np.testing.assert_allclose(out, exp, rtol=0, atol=2e-6 * np.abs(exp).max())
    whole = sym(mx.concatenate([x, mx.random.normal((30, K))]))[:M]  # lanes kernel
    assert mx.array_equal(whole, sym(x)).item()
