"""The extension's quantized K/V write: bit for bit what `PagedKVCache.write` stores through
`mx.quantize` (and the rotation), one op per stored part, rows outside the pool skipped."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine.kvcache import kv_cache
from engine.kvcache.quant import QuantSpec
from engine.model.cpu_ext import build, ops


@pytest.fixture(scope="module")
def ext():
    if not build.available():
        pytest.skip(f"CPU extension unavailable: {build.unavailable_reason()}")
    return build.load()


def empty_store(q: QuantSpec, H: int, S: int, D: int):
    return (mx.zeros((H, S, q.packed_dim(D)), dtype=mx.uint32),
            mx.zeros((H, S, q.num_groups(D)), dtype=mx.float16),
            mx.zeros((H, S, q.num_groups(D)), dtype=mx.float16))


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("bits,group", [(4, 32), (4, 64), (8, 32), (8, 64)])
@pytest.mark.parametrize("rotation", [0, 1])
@pytest.mark.parametrize("N", [1, 7, 40])  # a decode row, a few, a prefill chunk
def test_equals_mx_quantize_bit_for_bit(ext, dtype, bits, group, rotation, N):
    H, S, D = 3, 64, 64
    rows = (mx.random.normal((H, N, D)) * 3).astype(dtype)
    rows = mx.concatenate([rows[:, :1] * 0, rows[:, 1:]], axis=1)  # a row of zeros too
    q = QuantSpec(bits, group, rotation)
    slots = mx.array(np.random.default_rng(N).permutation(S)[:N].astype(np.int32))
    got = ops.kv_write_quant(empty_store(q, H, S, D), slots, rows, q)
    want = empty_store(q, H, S, D)
    for part, new in zip(want, kv_cache._quantize(rows, q), strict=True):
        part[:, slots] = new
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_array_equal(np.array(g), np.array(w))


def test_slots_outside_the_pool_are_skipped(ext):
    q = QuantSpec(8, 64)
    rows = mx.random.normal((2, 3, 64))
    got = ops.kv_write_quant(empty_store(q, 2, 8, 64), mx.array([1, 8, -1], dtype=mx.int32),
                             rows, q)
    written = np.array(got[1])[:, :, 0] != 0  # a row's scale is never 0 for random rows
    assert written[:, 1].all() and written.sum() == 2  # slot 1 of both heads only


def test_the_engine_writes_quantized_pools_through_the_extension(ext, default_model_ext):
    from engine import Engine, EngineConfig

    eng = Engine(default_model_ext, EngineConfig(kv_budget_bytes=16 << 20, kv_bits=4))
    try:
        assert eng.kv.quant_writer is not None  # the CPU path writes through the extension
    finally:
        eng.shutdown()


def test_bad_arguments_are_refused(ext):
    q = QuantSpec(8, 64)
    store = empty_store(q, 2, 8, 64)
    with pytest.raises(ValueError, match="does not fit"):
        ext.kv_write_quant(store[0], mx.array([0], dtype=mx.int32), mx.zeros((2, 1, 64)),
                           None, part=1, bits=8, group=64)  # the packed part as scales
    with pytest.raises(ValueError, match="signs"):
        ext.kv_write_quant(store[0], mx.array([0], dtype=mx.int32), mx.zeros((2, 1, 64)),
                           mx.ones((64, 64)), part=0, bits=8, group=64)


def test_the_row_writer_copies_blocks_of_codes_as_they_are(ext):
    """`kv_write` on a (H, blocks, D, ·) uint8 store (a residual pool's per-channel key
    codes, written a block at a time): what indexing stores, the bytes as given; rows of
    another dtype than a code store's are refused."""
    rng = np.random.default_rng(0)
    pool = mx.array(rng.integers(0, 255, (3, 10, 64, 8), dtype=np.uint8))
    new = mx.array(rng.integers(0, 255, (3, 2, 64, 8), dtype=np.uint8))
    at = mx.array([7, 2], dtype=mx.int32)
    want = mx.array(np.array(pool))
    want[:, at] = new
    assert mx.array_equal(ops.kv_write(pool, at, new), want).item()
    with pytest.raises(ValueError, match="dtype"):
        ops.kv_write(pool, at, new.astype(mx.float16))
    with pytest.raises(ValueError, match="rows"):
        ops.kv_write(pool, at, new[:, :, :32])


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rotation", [0, 1])
def test_channel_quant_equals_mlxs_ops_bit_for_bit(ext, dtype, bits, rotation):
    """The one-op per-channel key quantization of filled residual blocks: the bytes
    `quantize_channels` stores from the same (rotated) rows, a constant channel too."""
    from engine.kvcache import channel_quant
    from engine.kvcache import rotation as rot

    H, R, bs, D = 3, 6, 16, 64
    rng = np.random.default_rng(bits + rotation)
    res = rng.standard_normal((H, R * bs, D)) * np.where(np.arange(D) % 13 == 0, 20.0, 1.0)
    res[:, :, 5] = 0.75  # one channel constant over every block
    res = mx.array(res.astype(np.float32)).astype(dtype)
    at = mx.array([4, 1, 2], dtype=mx.int32)
    got = ops.channel_quant(res, at, bs, bits, bool(rotation))
    rows = res.reshape(H, R, bs, D)[:, at]
    if rotation:
        rows = rot.rotate(rows.reshape(H, -1, D)).reshape(rows.shape)
    want = channel_quant.quantize_channels(rows, bits)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert mx.array_equal(g, w).item()
