"""Tiled layers of a symmetric format (GGUF Q4_0 / Q8_0) hold one (1, 1) bias factor
instead of a bias per scale: the same results bit for bit, ~1/9 fewer bytes at 4 bits."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from engine.model.cpu_ext import build, linear, ops


@pytest.fixture(scope="module")
def tiled():
    if not build.available():
        pytest.skip(f"CPU extension unavailable: {build.unavailable_reason()}")
    if not ops.tiled_supported():
        pytest.skip("this CPU has no AVX-512 VNNI: the tiled matmul is not built")


def symmetric(N: int, K: int, group: int, bits: int, dtype=mx.float16, seed: int = 0):
    """Codes, scales and biases as a GGUF Q4_0/Q8_0 block converts: bias = -2^(bits-1) d."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 2 ** bits, size=(N, K)).astype(np.uint32)
    per = 32 // bits
    words = np.zeros((N, K // per), np.uint32)
    for j in range(per):
        words |= codes[:, j::per] << np.uint32(bits * j)
    d = rng.uniform(1e-3, 2e-2, size=(N, K // group)) * rng.choice([-1, 1], (N, K // group))
    d = mx.array(d.astype(np.float32)).astype(dtype)  # Q4_0's d has its extreme's sign
    return mx.array(words), d, d * -(2 ** (bits - 1))


def layer_of(w, s, b, group: int, bits: int, cls=nn.QuantizedLinear) -> nn.Module:
    N, K = w.shape[0], w.shape[1] * 32 // bits
    layer = cls(K, N, bias=False, group_size=group, bits=bits) if cls is nn.QuantizedLinear \
        else cls(N, K, group_size=group, bits=bits)
    layer.update({"weight": w, "scales": s, "biases": b})
    return layer


@pytest.mark.parametrize("bits,group", [(4, 32), (8, 32), (4, 64), (8, 128)])
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
@pytest.mark.parametrize("M", [1, 5, 40])  # tile_rows (decode) and the lanes kernel (prefill)
def test_a_bias_factor_gives_the_same_bits(tiled, bits, group, dtype, M):
    w, s, b = symmetric(64, 256, group, bits, dtype)
    assert linear.bias_factor(layer_of(w, s, b, group, bits)) == -(2 ** (bits - 1))
    sym = linear.CpuTiledLinear.from_quantized(layer_of(w, s, b, group, bits))
    assert sym["biases"].shape == (1, 1) and linear.scaled_biases(sym)
    x = mx.random.normal((M, 256))
    ref = ops.qmm(x, *ops.tile(w, s, b, group, bits), group_size=group, bits=bits, tiled=True)
    assert mx.array_equal(sym(x), ref).item()  # ref: the stored biases


def test_affine_and_odd_factors_keep_their_biases(tiled):
    w, s, b = symmetric(32, 128, 32, 4)
    assert linear.bias_factor(layer_of(w, s, b + 1e-3, 32, 4)) is None  # affine: a min
    assert linear.bias_factor(layer_of(w, s, s * -7.5, 32, 4)) is None  # not a power of two
    assert linear.bias_factor(layer_of(w, s, s * 4, 32, 4)) is None  # positive
    assert linear.bias_factor(layer_of(w, s, mx.abs(s) * -8, 32, 4)) is None  # signs differ
    odd = b.at[3, 1].add(mx.array(1.0, dtype=b.dtype))  # one group off
    assert linear.bias_factor(layer_of(w, s, odd, 32, 4)) is None
    assert linear.bias_factor(layer_of(w, s, s * -16, 32, 4)) == -16  # Q5_0's codes at 8 bits
    big = s.at[0, 0].add(mx.array(float("inf"), dtype=s.dtype))  # the largest scale: inf
    assert linear.bias_factor(layer_of(w, big, big * -8, 32, 4)) is None
    nan = b.at[0, 0].add(mx.array(float("nan"), dtype=b.dtype))
    assert linear.bias_factor(layer_of(w, s, nan, 32, 4)) is None
    kept = linear.CpuTiledLinear.from_quantized(layer_of(w, s, odd, 32, 4))
    assert kept["biases"].shape == s.shape


def test_a_factor_is_refused_outside_the_tiled_path(tiled):
    w, s, _ = symmetric(32, 128, 32, 4)
    factor = mx.full((1, 1), -8.0, dtype=s.dtype)
    with pytest.raises(ValueError, match="tiled"):
        ops.qmm(mx.zeros((1, 128)), w, s, factor, group_size=32, bits=4, tiled=False)
    with pytest.raises(ValueError, match="match"):  # (2, 1) is neither
        ops.qmm(mx.zeros((1, 128)), *ops.tile(w, s, s, 32, 4)[:2], mx.zeros((2, 1), s.dtype),
                group_size=32, bits=4, tiled=True)


@pytest.mark.parametrize("bits,group", [(4, 32), (8, 32), (4, 128)])
def test_a_symmetric_embedding_looks_up_and_projects_the_same(tiled, bits, group):
    w, s, b = symmetric(96, 256, group, bits)
    emb = layer_of(w, s, b, group, bits, nn.QuantizedEmbedding)
    ids = mx.array([[0, 17, 95], [16, 15, 3]])
    ref_rows, x = emb(ids), mx.random.normal((2, 256))
    new = linear.CpuTiledEmbedding.from_quantized(emb)
    assert linear.scaled_biases(new)
    assert mx.array_equal(new(ids), ref_rows).item()
    ref_head = ops.qmm(x, *ops.tile(w, s, b, group, bits), group_size=group, bits=bits,
                       tiled=True)
    assert mx.array_equal(new.as_linear(x), ref_head).item()


def test_symmetric_layers_fuse_only_with_their_kind(tiled):
    parts = [symmetric(n, 128, 32, 4, seed=i) for i, n in enumerate((32, 16, 16))]
    sym = [linear.CpuTiledLinear.from_quantized(layer_of(*p, 32, 4)) for p in parts]
    x = mx.random.normal((3, 128))
    refs = [m(x) for m in sym]
    fused = linear.fuse(sym)
    assert fused is not None and fused["biases"].shape == (1, 1)
    assert mx.array_equal(fused(x), mx.concatenate(refs, axis=-1)).item()
    w, s, b = parts[0]
    affine = linear.CpuTiledLinear.from_quantized(layer_of(w, s, b + 1e-3, 32, 4))
    q8 = symmetric(16, 128, 32, 8)
    wide = linear.CpuTiledLinear.from_quantized(layer_of(*q8, 32, 8))
    assert linear.fuse([affine, *[linear.CpuTiledLinear.from_quantized(layer_of(*p, 32, 4))
                                  for p in parts[1:]]]) is None
    assert linear.fuse([wide, linear.CpuTiledLinear.from_quantized(layer_of(*parts[1], 32, 4))
                        ]) is None


@pytest.mark.parametrize("bits", [4, 8])
def test_tiling_in_row_parts_gives_the_same_layout(tiled, bits, monkeypatch):
    # `tile` re-lays a big matrix (a tied embedding) some rows at a time to bound its memory
    w, s, b = symmetric(96, 256, 32, bits)
    whole = ops.tile(w, s, b, 32, bits)
    monkeypatch.setattr(ops, "TILE_CHUNK_WEIGHTS", 40 * 256)  # parts of 32, 32 and 32 rows
    parts = ops.tile(w, s, b, 32, bits)
    for a, c in zip(whole, parts, strict=True):
        assert a.shape == c.shape and mx.array_equal(a, c).item()
