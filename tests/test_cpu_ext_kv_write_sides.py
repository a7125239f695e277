"""The extension's one-node K/V write (`kv_write_sides`): the bytes of the part-by-part
writes, in place only when nothing else holds a store, and bad stores refused."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine.kvcache.quant import QuantSpec
from engine.model.cpu_ext import build, ops

H, S, D = 3, 64, 64


@pytest.fixture(scope="module")
def ext():
    if not build.available():
        pytest.skip(f"CPU extension unavailable: {build.unavailable_reason()}")
    return build.load()


def store(q: QuantSpec | None, slots: int = S) -> list[mx.array]:
    if q is None:
        return [mx.zeros((H, slots, D), dtype=mx.float16)]
    return [mx.zeros((H, slots, q.packed_dim(D)), dtype=mx.uint32),
            mx.zeros((H, slots, q.num_groups(D)), dtype=mx.float16),
            mx.zeros((H, slots, q.num_groups(D)), dtype=mx.float16)]


def fmt(side: str, q: QuantSpec | None) -> dict:
    return {} if q is None else {f"{side}_bits": q.bits, f"{side}_group": q.group_size,
                                 f"rotate_{side}": bool(q.rotation)}


def part_by_part(q: QuantSpec | None, slots, rows) -> list[mx.array]:
    if q is None:
        return [ops.kv_write(store(None)[0], slots, rows)]
    return list(ops.kv_write_quant(tuple(store(q)), slots, rows, q))


@pytest.mark.parametrize("kq,vq", [(None, None), (QuantSpec(8, 64, 1), QuantSpec(8, 64, 1)),
                                   (QuantSpec(4, 32, 0), QuantSpec(4, 64, 1)),
                                   (QuantSpec(8, 32, 1), None)])
@pytest.mark.parametrize("N", [1, 5])
def test_the_bytes_of_the_part_by_part_writes(ext, kq, vq, N):
    from engine.kvcache import rotation

    k_rows = (mx.random.normal((H, N, D)) * 2).astype(mx.float16)  # rows of either dtype
    v_rows = mx.random.normal((H, N, D))
    slots = mx.array(np.random.default_rng(N).permutation(S)[:N].astype(np.int32))
    signs = rotation.signs(D) if (kq and kq.rotation) or (vq and vq.rotation) else None
    got = ext.kv_write_sides(store(kq), store(vq), slots, k_rows, v_rows, signs,
                             **fmt("k", kq), **fmt("v", vq))
    want = part_by_part(kq, slots, k_rows) + part_by_part(vq, slots, v_rows)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_array_equal(np.array(g), np.array(w))


def test_a_store_held_elsewhere_is_copied_not_written(ext):
    """A snapshot (or any other holder) of the old stores must still read the old bytes."""
    q = QuantSpec(8, 64, 0)
    keys, values = store(q), store(None)
    mx.eval(*keys, *values)
    held = list(keys) + list(values)
    out = ext.kv_write_sides(keys, values, mx.array([3], dtype=mx.int32),
                             mx.ones((H, 1, D)), mx.ones((H, 1, D)), **fmt("k", q))
    mx.eval(*out)
    assert all(not np.array(a).any() for a in held)  # the old arrays untouched
    assert all(np.array(a)[:, 3].any() for a in out[1:])  # scales, biases, float pool


def test_a_store_nobody_else_holds_is_written_in_place(ext):
    """No copy of a pool nobody else holds: the write allocates nothing pool-sized."""
    slots = 1 << 16  # 12 MiB of float16 a side
    keys, values = store(None, slots), store(None, slots)
    mx.eval(*keys, *values)
    rows = mx.ones((H, 1, D), dtype=mx.float16)
    at = mx.array([7], dtype=mx.int32)
    mx.eval(rows, at)
    base = mx.get_active_memory()
    mx.reset_peak_memory()  # to 0: it follows the active memory from the next allocation on
    out = ext.kv_write_sides(keys, values, at, rows, rows)
    del keys, values  # the list holds the new arrays, as the pool's lists do
    mx.eval(*out)
    grew = max(mx.get_peak_memory(), base) - base  # a copy of either pool: 12 MiB
    assert grew < H * slots * D * 2 // 2
    assert float(out[0][0, 7, 0]) == 1.0 and float(out[1][2, 7, 5]) == 1.0


def test_bad_stores_are_refused(ext):
    q = QuantSpec(8, 64)
    at, rows = mx.array([0], dtype=mx.int32), mx.zeros((H, 1, D))
    with pytest.raises(ValueError, match="three"):
        ext.kv_write_sides(store(q)[:2], store(None), at, rows, rows, k_bits=8, k_group=64)
    with pytest.raises(ValueError, match="signs"):
        ext.kv_write_sides(store(q), store(None), at, rows, rows, k_bits=8, k_group=64,
                           rotate_k=True)
    with pytest.raises(ValueError, match="does not fit"):
        ext.kv_write_sides(store(q), store(None), at, rows, rows, k_bits=4, k_group=64)
    with pytest.raises(ValueError, match="rows must be"):
        ext.kv_write_sides(store(None), store(None), at, mx.zeros((H, 2, D)), rows)


LAYOUTS = {
    "f16": dict(),
    "q8 rotated": dict(k_quant=QuantSpec(8, 64, 1), v_quant=QuantSpec(8, 64, 1)),
    "k8v4 not rotated": dict(k_quant=QuantSpec(8, 64, 0), v_quant=QuantSpec(4, 32, 0)),
    "q4-kivi": dict(k_quant=QuantSpec(4, 64, 1), v_quant=QuantSpec(4, 64, 1), residual=True,
                    key_channel=True),
}


@pytest.mark.parametrize("fmt", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_the_pools_write_both_sides_in_one_op_with_the_same_bytes(ext, fmt):
    """`PagedKVCache.write` (and a residual pool's residual rows) through `kv_write_sides`:
    the bytes the one-op writes store side by side, blocks filled and quantized on the way."""
    from engine.kvcache.kv_cache import KVLayout, PagedKVCache
    from engine.kvcache.residual import ResidualKVCache

    layout = KVLayout(2, H, D, 4, mx.float16, **fmt)
    kind = ResidualKVCache if layout.residual else PagedKVCache
    writers = dict(quant_writer=ops.kv_write_quant) | (
        {"channel_quant": ops.channel_quant} if layout.residual else {})
    pools = [kind(layout, 8, ops.kv_write, **writers, sides_writer=s)
             for s in (None, ops.kv_write_sides)]
    rng = np.random.default_rng(3)
    for at in ([0, 1, 2], [3], [12, 13], [14, 15, 16, 17, 18]):  # rows filling blocks 0 and 3
        slots = mx.array(at, dtype=mx.int32)
        k, v = (mx.array(rng.standard_normal((H, len(at), D)).astype(np.float16))
                for _ in range(2))
        for kv in pools:
            for layer in range(2):
                kv.write(layer, slots, k, v)
    plain, one = ((np.array(a) for a in kv_arrays(kv)) for kv in pools)
    for a, b in zip(plain, one, strict=True):
        np.testing.assert_array_equal(a, b)


def kv_arrays(kv) -> list[mx.array]:
    out = []
    for side in kv.arrays:
        for st in side:
            out += list(st) if isinstance(st, tuple) else [st]
    return out
