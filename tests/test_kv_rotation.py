"""The rotation of quantized K/V rows (`kvcache.rotation`): orthonormal, fixed forever,
transparent to attention, and worth its cost on keys with outlier channels."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine.kvcache import rotation
from engine.kvcache.disk.spec import EntrySpec
from engine.kvcache.kv_cache import KVLayout, PagedKVCache
from engine.kvcache.quant import QuantSpec, rotation_block
from engine.model.attention import paged_attention


@pytest.mark.parametrize("head_dim", [64, 128, 96, 80])
def test_the_rotation_is_orthonormal_and_block_diagonal(head_dim):
    m = np.array(rotation.matrix(head_dim))
    np.testing.assert_allclose(m @ m.T, np.eye(head_dim), atol=1e-6)
    n = rotation_block(head_dim)
    assert n == {64: 64, 128: 128, 96: 32, 80: 16}[head_dim]
    outside = m.copy()
    for i in range(0, head_dim, n):
        outside[i:i + n, i:i + n] = 0
    assert not outside.any()  # rows of one block never leak into another
    assert len(set(np.sign(m[:n, 0]).tolist())) == 2  # the signs are mixed, not all +


def test_the_signs_never_change():
    # stored entries rotate back with these exact signs: a new pattern is a new rotation id
    first = np.sign(np.array(rotation.matrix(64))[:16, 0]).astype(int).tolist()
    assert first == [-1, 1, 1, 1, 1, 1, 1, 1, 1, 1, -1, 1, -1, -1, 1, -1]


def test_rotate_then_unrotate_gives_the_rows_back():
    x = mx.random.normal((3, 5, 64))
    np.testing.assert_allclose(np.array(rotation.unrotate(rotation.rotate(x))), np.array(x),
                               atol=1e-5)


def test_spec_names_and_disk_headers_carry_the_rotation():
    plain, rotated = QuantSpec(4, 64), QuantSpec(4, 64, 1)
    assert (plain.name, rotated.name) == ("q4g64", "q4g64r1")
    spec = EntrySpec(2, 3, 64, "float16", rotated, plain)
    doc = spec.to_dict()
    assert doc["k_quant"] == {"bits": 4, "group_size": 64, "rotation": 1}
    assert doc["v_quant"] == {"bits": 4, "group_size": 64}  # unrotated headers as before
    assert EntrySpec.from_dict(doc) == spec
    assert "q4g64r1" in spec.kv_format and spec.kv_format != EntrySpec(
        2, 3, 64, "float16", plain, plain).kv_format  # never the same prefix key
    with pytest.raises(ValueError):
        QuantSpec(4, 64, 2)  # an unknown rotation is no format
    with pytest.raises(ValueError):
        EntrySpec.from_dict({**doc, "k_quant": {"bits": 4, "group_size": 64, "spin": 1}})
    assert not QuantSpec(8, 32, 1).fits(72)  # 72 = 8 x 9: no block of 16 to rotate


def outlier_keys(T: int, D: int, seed: int) -> mx.array:
    """Keys with two channels ~10x the others, as this model family's keys have."""
    rng = np.random.default_rng(seed)
    k = rng.normal(size=(1, T, D)).astype(np.float32)
    k[..., 3] *= 12
    k[..., 40] *= -10
    return mx.array(k)


def attend(bits: int, rot: int, q, k, v, T: int):
    # keys quantized (their outliers are what rotation is for), values float
    layout = KVLayout(1, 1, 64, 16, mx.float32, QuantSpec(bits, 64, rot))
    kv = PagedKVCache(layout, T // 16)
    kv.write(0, mx.arange(T), k, v)
    k_pool, v_pool = kv.block_view(0)
    table = mx.arange(T // 16)[None]
    return paged_attention(q, k_pool, v_pool, table, [T], 64 ** -0.5)


@pytest.mark.parametrize("bits", [4, 8])
def test_rotated_keys_are_stored_closer_and_attend_closer(bits):
    T = 256
    k = outlier_keys(T, 64, 1)
    mx.random.seed(bits)
    v, q = mx.random.normal((1, T, 64)), mx.random.normal((1, 2, 1, 64)) * 0.5

    def stored(rot: int) -> mx.array:  # the keys as attention reads them back
        spec = QuantSpec(bits, 64, rot)
        layout = KVLayout(1, 1, 64, 16, mx.float32, spec)
        kv = PagedKVCache(layout, T // 16)
        kv.write(0, mx.arange(T), k, v)
        rows = kv.block_view(0)[0].gather(mx.arange(T // 16)).reshape(1, T, 64)
        return rotation.unrotate(rows) if rot else rows

    key_err = {rot: float(mx.abs(stored(rot) - k).mean()) for rot in (0, 1)}
    assert key_err[1] < key_err[0] / 2, key_err  # outliers no longer set every group's step
    exact = attend_float(q, k, v, T)
    out_err = {rot: float(mx.abs(attend(bits, rot, q, k, v, T) - exact).mean()) for rot in (0, 1)}
    assert out_err[1] < out_err[0], out_err  # and attention, through the dispatcher, follows


def attend_float(q, k, v, T):
    layout = KVLayout(1, 1, 64, 16, mx.float32)
    kv = PagedKVCache(layout, T // 16)
    kv.write(0, mx.arange(T), k, v)
    k_pool, v_pool = kv.block_view(0)
    return paged_attention(q, k_pool, v_pool, mx.arange(T // 16)[None], [T], 64 ** -0.5)


@pytest.mark.parametrize("head_dim", [64, 128, 96, 80])
@pytest.mark.parametrize("path", ["extension", "gemm"])
def test_rotate_is_the_matrix_product_on_either_path(head_dim, path, monkeypatch):
    if path == "gemm":  # MLX's own route (no extension, or a GPU)
        monkeypatch.setattr(rotation, "_extension", lambda: None)
    elif rotation._extension() is None:
        pytest.skip("CPU extension unavailable")
    x = mx.random.normal((2, 5, head_dim))
    want = np.array(x) @ np.array(rotation.matrix(head_dim))
    np.testing.assert_allclose(np.array(rotation.rotate(x)), want, atol=1e-5)
    np.testing.assert_allclose(np.array(rotation.unrotate(mx.array(want))), np.array(x),
                               atol=1e-5)
    half = x.astype(mx.float16)
    assert rotation.rotate(half).dtype == mx.float16  # rounded back to the rows' dtype


@pytest.mark.parametrize("head_dim", [64, 128, 96, 48, 40])
def test_the_extensions_rotation_is_the_butterflies_bit_for_bit(head_dim):
    """Stored rows must rotate back the same way forever: the extension's transform (vector
    lanes where the blocks allow, else scalar) gives exactly the float32 butterflies of
    `kvcache.rotation`'s definition, in their order."""
    if rotation._extension() is None:
        pytest.skip("CPU extension unavailable")
    x = np.random.default_rng(head_dim).standard_normal((7, head_dim)).astype(np.float32)
    signs = np.array(rotation.signs(head_dim))
    n = rotation_block(head_dim)
    y = x * signs
    for b0 in range(0, head_dim, n):
        length = 1
        while length < n:
            for i in range(b0, b0 + n, 2 * length):
                a, b = y[:, i:i + length].copy(), y[:, i + length:i + 2 * length].copy()
                y[:, i:i + length], y[:, i + length:i + 2 * length] = a + b, a - b
            length *= 2
    y = y * np.float32(1 / np.sqrt(np.float32(n)))
    assert np.array_equal(np.array(rotation.rotate(mx.array(x))), y)
