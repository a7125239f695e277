"""The extension's `layer_head` and `layer_tail` against the separate ops they replace,
bit for bit, over dtypes, RoPE layouts, partial rotary dims, ragged offsets and 4/8-bit
weights (the default model covers one case of each: tests/test_cpu_ext_layer_ops.py)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from engine.model.cpu_ext import build, ops
from engine.model.cpu_ext.linear import rebind
from engine.model.cpu_ext.norm_rope import CpuRoPE, rms_norm, swiglu

HEADS, KV_HEADS, D, HIDDEN, FF = 6, 2, 64, 128, 160


@pytest.fixture(scope="module")
def ext():
    if not build.available():
        pytest.skip(f"CPU extension unavailable: {build.unavailable_reason()}")
    return build.load()


def linear(n_out: int, n_in: int, bits: int, dtype, seed: int):
    mx.random.seed(seed)
    w, s, b = mx.quantize(mx.random.normal((n_out, n_in)) * 0.05, group_size=32, bits=bits)
    return [w, s.astype(dtype), b.astype(dtype)], (32, bits, False)


def qmm(x, lin):
    (w, s, b), (group, bits, tiled) = lin
    return ops.qmm(x, w, s, b, group_size=group, bits=bits, tiled=tiled)


def bits_of(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32))


def assert_head(got, q, k, v, rope, offs) -> None:
    """``got`` (layer_head's [q, k, v]) is bit for bit the projections' outputs q, k, v
    (B, L, ·) after RoPE and the head layouts."""
    B, L = q.shape[:2]
    q = rope(q.reshape(B, L, HEADS, D).transpose(0, 2, 1, 3), offset=offs)
    k = rope(k.reshape(B, L, KV_HEADS, D).transpose(0, 2, 1, 3), offset=offs)
    v = v.reshape(B, L, KV_HEADS, D).transpose(0, 2, 1, 3)
    want = [q] + [t.transpose(1, 0, 2, 3).reshape(KV_HEADS, B * L, D) for t in (k, v)]
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_array_equal(bits_of(g), bits_of(w))


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("B,L,offsets", [(1, 1, [127]), (1, 5, [0]), (3, 1, [5, 900, 33])])
@pytest.mark.parametrize("traditional,dims,bits", [(False, 64, 4), (True, 64, 8),
                                                   (False, 32, 4)])
def test_head_equals_norm_qmm_split_rope(ext, dtype, B, L, offsets, traditional, dims, bits):
    h = (mx.random.normal((B, L, HIDDEN)) * 2).astype(dtype)
    norm = (mx.random.normal((HIDDEN,)) * 0.1 + 1).astype(dtype)
    lin = linear((HEADS + 2 * KV_HEADS) * D, HIDDEN, bits, dtype, seed=L)
    rope = rebind(CpuRoPE, nn.RoPE(dims, traditional=traditional, base=10000.0))
    offs = mx.array(offsets, dtype=mx.int32)
    got = ext.layer_head(h, norm, lin[0], offs, eps=1e-5, specs=[lin[1]], heads=HEADS,
                         kv_heads=KV_HEADS, dims=dims, traditional=traditional, base=10000.0,
                         scale=1.0)
    qkv = qmm(rms_norm(h, norm, 1e-5), lin)
    q, k, v = mx.split(qkv, [HEADS * D, (HEADS + KV_HEADS) * D], axis=-1)
    assert_head(got, q, k, v, rope, offs)


def assert_tail(ext, h, att, norm, o, gate_up, down) -> None:
    """layer_tail of these is bit for bit the separate ops: o_proj, residual, norm,
    gate/up, swiglu, down, residual."""
    B, L = h.shape[:2]
    got = ext.layer_tail(h, att, o[0], norm, gate_up[0], down[0], eps=1e-6, o_spec=o[1],
                         gate_up_spec=gate_up[1], down_spec=down[1])
    h1 = h + qmm(att.transpose(0, 2, 1, 3).reshape(B, L, -1), o)
    gate, up = mx.split(qmm(rms_norm(h1, norm, 1e-6), gate_up), [FF], axis=-1)
    want = h1 + qmm(swiglu(gate, up), down)
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_array_equal(bits_of(got), bits_of(want))


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("B,L", [(1, 1), (1, 6), (4, 1)])
@pytest.mark.parametrize("bits", [4, 8])
def test_tail_equals_o_residual_norm_mlp_residual(ext, dtype, B, L, bits):
    h = mx.random.normal((B, L, HIDDEN)).astype(dtype)
    att = mx.random.normal((B, HEADS, L, D)).astype(dtype)
    norm = (mx.random.normal((HIDDEN,)) * 0.1 + 1).astype(dtype)
    o = linear(HIDDEN, HEADS * D, bits, dtype, 1)
    gate_up = linear(2 * FF, HIDDEN, bits, dtype, 2)
    down = linear(HIDDEN, FF, 8 if bits == 4 else 4, dtype, 3)  # a K-quant file mixes bits
    assert_tail(ext, h, att, norm, o, gate_up, down)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
@pytest.mark.parametrize("B,L", [(1, 1), (2, 7)])
@pytest.mark.parametrize("tiled", [False, True])
def test_head_with_q_k_v_apart_equals_the_separate_ops(ext, dtype, B, L, tiled):
    # a K-quant file's v (Q6_K -> 8 bits) next to 4-bit q and k: three products, one op
    if tiled and not ops.tiled_supported():
        pytest.skip("this CPU has no AVX-512 VNNI: the tiled matmul is not built")
    make = tiled_linear if tiled else linear
    parts = [make(HEADS * D, HIDDEN, 4, dtype, 1), make(KV_HEADS * D, HIDDEN, 4, dtype, 2),
             make(KV_HEADS * D, HIDDEN, 8, dtype, 3)]
    h = (mx.random.normal((B, L, HIDDEN)) * 2).astype(dtype)
    norm = (mx.random.normal((HIDDEN,)) * 0.1 + 1).astype(dtype)
    rope = rebind(CpuRoPE, nn.RoPE(D, traditional=False, base=10000.0))
    offs = mx.array([3], dtype=mx.int32)
    got = ext.layer_head(h, norm, [a for p in parts for a in p[0]], offs, eps=1e-5,
                         specs=[p[1] for p in parts], heads=HEADS, kv_heads=KV_HEADS, dims=D,
                         traditional=False, base=10000.0, scale=1.0)
    x = rms_norm(h, norm, 1e-5)
    q, k, v = (qmm(x, p) for p in parts)
    assert_head(got, q, k, v, rope, offs)
    wrong = [make((HEADS + 1) * D, HIDDEN, 4, dtype, 4), make((KV_HEADS - 1) * D, HIDDEN, 4,
                                                             dtype, 5), parts[2]]
    with pytest.raises(ValueError, match="heads, kv_heads"):  # the right total, split wrong
        ext.layer_head(h, norm, [a for p in wrong for a in p[0]], offs, eps=1e-5,
                       specs=[p[1] for p in wrong], heads=HEADS, kv_heads=KV_HEADS, dims=D,
                       traditional=False, base=10000.0, scale=1.0)


def tiled_linear(n_out: int, n_in: int, bits: int, dtype, seed: int, symmetric: bool = False):
    (w, s, b), (group, bits, _) = linear(n_out, n_in, bits, dtype, seed)
    if symmetric:  # a GGUF Q4_0/Q8_0 layer: one bias factor (cpu_ext.linear.bias_factor)
        b = mx.full((1, 1), -(2 ** (bits - 1)), dtype=dtype)
    return list(ops.tile(w, s, b, group, bits)), (group, bits, True)


@pytest.mark.parametrize("B,L", [(2, 150), (1, 128), (1, 129), (3, 1)])
@pytest.mark.parametrize("dtype,symmetric", [(mx.float32, False), (mx.float16, True),
                                             (mx.bfloat16, False)])
def test_a_tiled_tail_in_row_passes_equals_the_separate_ops(ext, B, L, dtype, symmetric):
    # A prefill chunk's tail runs 64 rows at a time when its linears are tiled (bounding
    # its MLP activations); the rows' results must not change.
    if not ops.tiled_supported():
        pytest.skip("this CPU has no AVX-512 VNNI: the tiled matmul is not built")
    h = mx.random.normal((B, L, HIDDEN)).astype(dtype)
    att = mx.random.normal((B, HEADS, L, D)).astype(dtype)
    norm = (mx.random.normal((HIDDEN,)) * 0.1 + 1).astype(dtype)
    o = tiled_linear(HIDDEN, HEADS * D, 4, dtype, 1, symmetric)
    gate_up = tiled_linear(2 * FF, HIDDEN, 4, dtype, 2, symmetric)
    down = tiled_linear(HIDDEN, FF, 8, dtype, 3, symmetric)
    assert_tail(ext, h, att, norm, o, gate_up, down)


def test_wrong_shapes_are_refused_in_one_line(ext):
    lin = linear((HEADS + 2 * KV_HEADS) * D, HIDDEN, 4, mx.float32, 0)
    args = dict(eps=1e-5, specs=[lin[1]], heads=HEADS, kv_heads=KV_HEADS, dims=D,
                traditional=False, base=1e4, scale=1.0)
    offs = mx.array([0], dtype=mx.int32)
    with pytest.raises(ValueError, match="h \\(B, L, hidden\\)"):
        ext.layer_head(mx.zeros((1, HIDDEN)), mx.ones((HIDDEN,)), lin[0], offs, **args)
    with pytest.raises(ValueError, match="qmm: shapes"):
        ext.layer_head(mx.zeros((1, 1, 96)), mx.ones((96,)), lin[0], offs, **args)
    with pytest.raises(ValueError, match="offsets"):
        ext.layer_head(mx.zeros((2, 1, HIDDEN)), mx.ones((HIDDEN,)), lin[0],
                       mx.array([0, 1, 2], dtype=mx.int32), **args)
    with pytest.raises(ValueError, match="rope dims"):
        ext.layer_head(mx.zeros((1, 1, HIDDEN)), mx.ones((HIDDEN,)), lin[0], offs,
                       **{**args, "dims": 66})
    with pytest.raises(ValueError, match="a spec"):
        ext.layer_head(mx.zeros((1, 1, HIDDEN)), mx.ones((HIDDEN,)), lin[0], offs,
                       **{**args, "specs": [lin[1], lin[1]]})
