"""The extension's tiled 4/5/6/8-bit matmul (int16 x, AVX-512 VNNI) and its one-op K/V write.

The tiled matmul is checked two ways: exactly, against the formula it promises computed
in float64 (x quantized to int16 per group, exact integer dot products, then scale and
bias), and loosely, against MLX's own quantized matmul, which it approximates to about
float16 precision."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiled_oracle import promised, quantized

from engine.kvcache.kv_cache import KVLayout, PagedKVCache
from engine.model.cpu_ext import build, linear, ops


@pytest.fixture(scope="module")
def ext():
    if not build.available():
        pytest.skip(f"CPU extension unavailable: {build.unavailable_reason()}")
    return build.load()


@pytest.fixture(scope="module")
def tiled(ext):
    if not ops.tiled_supported():
        pytest.skip("this CPU has no AVX-512 VNNI: the tiled matmul is not built")


@pytest.mark.parametrize("bits", [4, 5, 6, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("M,N,K", [(1, 16, 128), (3, 96, 256), (33, 48, 512), (70, 160, 384)])
def test_tiled_qmm_computes_what_it_promises(tiled, bits, group, M, N, K):
    w, s, b = quantized(N, K, group, seed=M + N, bits=bits)
    x = mx.random.normal((M, K))
    x = x.at[0, 5].add(80.0)  # an outlier, as the default model's activations have
    out = ops.qmm(x, *ops.tile(w, s, b, group, bits), group_size=group, bits=bits, tiled=True)
    exp = promised(x, w, s, b, group, bits)
    assert out.shape == (M, N) and out.dtype == mx.float32
    np.testing.assert_allclose(np.array(out), exp, rtol=0, atol=2e-6 * np.abs(exp).max())
    ref = mx.quantized_matmul(x, w, s, b, transpose=True, group_size=group, bits=bits)
    err = (mx.abs(out - ref).max() / mx.abs(ref).max()).item()
    assert err < 2e-3, err  # about float16's precision, not int8's ~1 %


@settings(max_examples=15, deadline=None)
@given(rows=st.integers(1, 40), split=st.integers(1, 39))
def test_tiled_rows_do_not_depend_on_the_batch(tiled, rows, split):
    """A row's result is the same alone or in any batch, decode or prefill sized."""
    w, s, b = ops.tile(*quantized(64, 256, 32, seed=3), 32, 4)
    x = mx.random.normal((rows, 256), key=mx.random.key(rows))
    whole = ops.qmm(x, w, s, b, group_size=32, bits=4, tiled=True)
    k = min(split, rows)
    parts = [ops.qmm(x[:k], w, s, b, group_size=32, bits=4, tiled=True)]
    if k < rows:
        parts.append(ops.qmm(x[k:], w, s, b, group_size=32, bits=4, tiled=True))
    assert mx.array_equal(whole, mx.concatenate(parts)).item()


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_the_relayout_op_writes_the_layout_mlx_ops_spell_out(ext, bits, group):
    """`tile_rows` (one extension op) gives the bytes of the MLX-ops re-layout, which
    spells the documented layout out; several tiles, rows that differ."""
    w, _, _ = quantized(48, 256, group, seed=bits + group, bits=bits)
    got = ext.tile_rows(w, group_size=group, bits=bits)
    assert got.dtype == mx.uint32 and got.shape == w.shape
    assert mx.array_equal(got, ops.tile_rows_mlx(w, group, bits)).item()
    assert not mx.array_equal(got, w).item()  # a re-layout, not a copy
    with pytest.raises(ValueError):
        ext.tile_rows(w[:40], group_size=group, bits=bits)  # rows not in 16s


def test_tiles_stack_and_slice_at_multiples_of_16(tiled):
    """`linear.fuse` concatenates tiled layers and re-points each at its slice."""
    parts = [quantized(n, 128, 32, seed=n) for n in (32, 16, 48)]
    tiles = [ops.tile(*p, 32, 4) for p in parts]
    fused = [mx.concatenate([t[i] for t in tiles]) for i in range(3)]
    x = mx.random.normal((2, 128))
    whole = ops.qmm(x, *fused, group_size=32, bits=4, tiled=True)
    alone = mx.concatenate([ops.qmm(x, *t, group_size=32, bits=4, tiled=True) for t in tiles],
                           axis=1)
    assert mx.array_equal(whole, alone).item()
    sliced = [a[32:48] for a in fused]
    assert mx.array_equal(ops.qmm(x, *sliced, group_size=32, bits=4, tiled=True),
                          alone[:, 32:48]).item()


def test_nan_input_gives_nan_rows_only(tiled):
    w, s, b = ops.tile(*quantized(32, 64, 32, seed=1), 32, 4)
    x = mx.random.normal((3, 64)).at[1, 7].add(mx.array(float("nan")))
    out = np.array(ops.qmm(x, w, s, b, group_size=32, bits=4, tiled=True))
    assert np.isnan(out[1]).all() and np.isfinite(out[[0, 2]]).all()


def test_tiled_qmm_rejects_what_it_cannot_take(tiled):
    w, s, b = quantized(40, 64, 32, seed=1)  # 40 rows: not whole tiles
    with pytest.raises(ValueError, match="rows in 16s"):
        ops.tile(w, s, b, 32, 4)
    with pytest.raises(ValueError, match="tiled"):
        ops.qmm(mx.zeros((1, 64)), w, s, b, group_size=32, bits=4, tiled=True)


@pytest.mark.parametrize("bits,group", [(8, 32), (4, 32), (4, 64), (4, 128), (8, 128), (5, 32),
                                        (6, 32), (6, 128)])
def test_tiled_embedding_looks_up_and_projects_like_mlx(tiled, bits, group):
    import mlx.nn as nn

    emb = nn.QuantizedEmbedding(96, 256, group_size=group, bits=bits)
    emb.update({"scales": emb.scales.astype(mx.float16), "biases": emb.biases.astype(mx.float16)})
    assert linear.tileable(emb)
    ids = mx.array([[0, 17, 95], [16, 15, 3]])
    ref_rows, x = emb(ids), mx.random.normal((2, 256))
    ref_head = emb.as_linear(x)
    new = linear.CpuTiledEmbedding.from_quantized(emb)
    assert mx.array_equal(new(ids), ref_rows).item()  # the lookup is exact
    err = (mx.abs(new.as_linear(x) - ref_head).max() / mx.abs(ref_head).max()).item()
    assert err < 2e-3, err


def untiled_lookup(emb, ids: mx.array) -> mx.array:
    """The lookup built from MLX ops (`ops.untile_rows`, then `mx.dequantize`)."""
    w, s, b = ops.untile_rows(emb["weight"], emb["scales"], emb["biases"], ids, emb.group_size,
                              emb.bits)
    return mx.dequantize(w, scales=s, biases=b, group_size=emb.group_size, bits=emb.bits)


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
@pytest.mark.parametrize("group,factor", [(32, None), (64, None), (32, -128.0), (64, -3.1)])
def test_the_8_bit_lookup_op_gives_mlx_dequantize_bits_for_every_row(tiled, dtype, group,
                                                                      factor):
    """`tiled_rows8` (one op) against the MLX-ops build, every row of a table whose scales
    and biases span many magnitudes (each product and sum rounds); a symmetric format's
    biases as one (1, 1) factor (the default model's Q8_0), a power of two or not."""
    import mlx.nn as nn

    emb = nn.QuantizedEmbedding(4096, 192, group_size=group, bits=8)
    mag = mx.power(2.0, mx.random.randint(-12, 6, emb.scales.shape).astype(mx.float32))
    emb.update({"scales": (emb.scales * mag).astype(dtype),
                "biases": (emb.biases * mag * 3.1).astype(dtype) if factor is None
                else mx.array([[factor]], dtype=dtype)})
    new = linear.CpuTiledEmbedding.from_quantized(emb)
    ids = mx.arange(4096, dtype=mx.int32).reshape(64, 64)
    got = new(ids)
    assert got.dtype == dtype and got.shape == (64, 64, 192)
    assert mx.array_equal(got, untiled_lookup(new, ids)).item()
    if factor is None:  # (MLX's own layer cannot gather a factor's rows)
        assert mx.array_equal(got, emb(ids)).item()


def test_the_default_models_lookup_is_the_same_for_every_token(default_model_ext):
    emb = default_model_ext.model.model.embed_tokens
    assert isinstance(emb, linear.CpuTiledEmbedding) and emb.bits == 8
    ids = mx.arange(emb["scales"].shape[0], dtype=mx.int32)
    assert mx.array_equal(emb(ids), untiled_lookup(emb, ids)).item()


def test_the_8_bit_lookup_op_refuses_bad_shapes(tiled):
    ext = build.require()
    w, s = mx.zeros((32, 48), mx.uint32), mx.zeros((32, 6), mx.float16)
    with pytest.raises(ValueError, match="multiple of 16"):
        ext.tiled_rows8(w[:17], s[:17], s[:17], mx.array([0]), 32)
    with pytest.raises(ValueError, match="one float dtype"):
        ext.tiled_rows8(w, s, s.astype(mx.float32), mx.array([0]), 32)
    with pytest.raises(ValueError, match=r"\(1, 1\)"):
        ext.tiled_rows8(w, s, s[:1, :2], mx.array([0]), 32)
    with pytest.raises(ValueError, match="int32"):
        ext.tiled_rows8(w, s, s, mx.array([0.5]), 32)


def test_tiled_linear_keeps_the_layer_bytes(tiled):
    import mlx.nn as nn

    layer = nn.QuantizedLinear(128, 64, bias=True, group_size=32, bits=4)
    layer.update({"scales": layer.scales.astype(mx.float16),
                  "biases": layer.biases.astype(mx.float16)})
    assert linear.tileable(layer)
    x = mx.random.normal((5, 128))
    ref = layer(x)
    new = linear.CpuTiledLinear.from_quantized(layer)
    assert new["weight"].nbytes == layer["weight"].nbytes and "bias" in new
    err = (mx.abs(new(x) - ref).max() / mx.abs(ref).max()).item()
    assert err < 2e-3, err


# -- kv_write ------------------------------------------------------------------

@pytest.mark.parametrize("pool_dtype,row_dtype", [(mx.float16, mx.float32),
                                                  (mx.float16, mx.float16),
                                                  (mx.bfloat16, mx.float32),
                                                  (mx.float32, mx.float16)])
def test_kv_write_equals_indexed_assignment(ext, pool_dtype, row_dtype):
    H, S, D, N = 3, 64, 32, 5
    pool = mx.random.normal((H, S, D)).astype(pool_dtype)
    slots = mx.array([7, 0, 63, 20, 21], dtype=mx.int32)
    rows = mx.random.normal((H, N, D)).astype(row_dtype)
    ref = mx.array(pool)
    ref[:, slots] = rows.astype(pool_dtype)
    out = ops.kv_write(pool, slots, rows)
    assert out.dtype == pool_dtype and mx.array_equal(out, ref).item()
    # a transposed (strided) rows view is read correctly too
    t = mx.random.normal((N, H, D)).astype(row_dtype)
    ref[:, slots] = t.transpose(1, 0, 2).astype(pool_dtype)
    assert mx.array_equal(ops.kv_write(out, slots, t.transpose(1, 0, 2)), ref).item()


def test_kv_write_leaves_a_shared_pool_alone(ext):
    """A pool someone else still holds is copied, not written in place."""
    pool = mx.zeros((2, 8, 16))
    mx.eval(pool)
    keep = pool  # a second reference: not donatable
    out = ops.kv_write(pool, mx.array([3], dtype=mx.int32), mx.ones((2, 1, 16)))
    mx.eval(out)
    assert keep.sum().item() == 0 and out.sum().item() == 32


def test_kv_write_skips_slots_outside_the_pool(ext):
    pool = mx.zeros((1, 4, 16))
    out = ops.kv_write(pool, mx.array([-1, 4, 2], dtype=mx.int32), mx.ones((1, 3, 16)))
    assert out[0, :, 0].tolist() == [0, 0, 1, 0]
    with pytest.raises(ValueError, match="rows must be"):
        ops.kv_write(pool, mx.array([0], dtype=mx.int32), mx.ones((1, 2, 16)))


def test_paged_cache_with_the_row_writer_matches_the_plain_one(ext):
    layout = KVLayout(num_layers=2, num_kv_heads=3, head_dim=16, block_size=4,
                      dtype=mx.float16)
    plain, fast = PagedKVCache(layout, 6), PagedKVCache(layout, 6, row_writer=ops.kv_write)
    for step in range(3):
        slots = mx.array([step * 5, step * 5 + 1], dtype=mx.int32)
        k, v = mx.random.normal((3, 2, 16)), mx.random.normal((3, 2, 16))
        for kv in (plain, fast):
            kv.write(step % 2, slots, k, v)
    for a, b in zip(plain.keys + plain.values, fast.keys + fast.values, strict=True):
        assert mx.array_equal(a, b).item()


@pytest.mark.parametrize("bits", [5, 6])
def test_5_and_6_bit_layers_widen_exactly_off_the_tiled_path(ext, bits):
    """Without the tiled path (no VNNI, ``KVCHAT_TILED=0``) a 5/6-bit layer (GGUF Q5, Q6_K)
    runs the extension's 8-bit path with the same codes: the same weights."""
    import mlx.nn as nn

    from engine.model.cpu_ext import bit_planes

    layer = nn.QuantizedLinear(128, 32, bias=False, group_size=32, bits=bits)
    ref = mx.dequantize(layer["weight"], layer["scales"], layer["biases"], group_size=32,
                        bits=bits)
    w8 = bit_planes.widen_to_8(layer["weight"], bits)
    assert mx.array_equal(mx.dequantize(w8, layer["scales"], layer["biases"], group_size=32,
                                        bits=8), ref).item()
    assert mx.array_equal(bit_planes.pack_codes(bit_planes.unpack_codes(layer["weight"], bits),
                                                bits), layer["weight"]).item()
    model = nn.Sequential(layer)
    x = mx.random.normal((2, 128))
    want = model(x)
    assert linear.install(model, tiled=False) == 1
    assert type(model.layers[0]) is linear.CpuQuantizedLinear and model.layers[0].bits == 8
    err = (mx.abs(model(x) - want).max() / mx.abs(want).max()).item()
    assert err < 1e-5, err
