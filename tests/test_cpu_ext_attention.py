"""The extension's paged decode attention against `paged_attention_ref`, its routing from
`paged_attention` on CPU, and the fallback after a bad first launch."""

from __future__ import annotations

import random
import warnings

import mlx.core as mx
import numpy as np
import pytest

from engine.kvcache.quant import QuantSpec
from engine.kvcache.quantized_blocks import QuantizedBlocks
from engine.model.attention import cpu, guard, paged_attention
from engine.model.attention.reference import paged_attention_ref
from engine.model.cpu_ext import build

TOLERANCE = {mx.float32: 2e-5, mx.float16: 2e-3, mx.bfloat16: 1.6e-2}


@pytest.fixture(scope="module", autouse=True)
def ext():
    if not build.available():
        pytest.skip(f"CPU extension unavailable: {build.unavailable_reason()}")
    guard.GUARD.reset()
    yield
    guard.GUARD.reset()


def quantize_pool(pool: mx.array, bits: int, group: int) -> QuantizedBlocks:
    H, nb, bs, D = pool.shape
    data, scales, biases = mx.quantize(pool.reshape(-1, D), group_size=group, bits=bits)
    return QuantizedBlocks(data.reshape(H, nb, bs, -1), scales.astype(mx.float16).reshape(
        H, nb, bs, -1), biases.astype(mx.float16).reshape(H, nb, bs, -1),
        QuantSpec(bits, group), D)


def make_case(lens, Hq, Hkv, D, bs, *, seed, pool_dtype=mx.float32, q_dtype=mx.float32,
              k_quant=None, v_quant=None):
    """Scattered (shuffled) blocks per sequence, padding entries pointing at a valid block."""
    rng = random.Random(seed)
    num_blocks = sum(-(-n // bs) for n in lens) + 2
    mx.random.seed(seed)
    k = mx.random.normal((Hkv, num_blocks, bs, D)).astype(pool_dtype)
    v = mx.random.normal((Hkv, num_blocks, bs, D)).astype(pool_dtype)
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    width = max(-(-n // bs) for n in lens)
    tables, start = [], 0
    for n in lens:
        nb = -(-n // bs)
        tables.append(ids[start:start + nb] + [ids[-1]] * (width - nb))
        start += nb
    q = mx.random.normal((len(lens), Hq, 1, D)).astype(q_dtype)
    if k_quant:
        k = quantize_pool(k, *k_quant)
    if v_quant:
        v = quantize_pool(v, *v_quant)
    return q, k, v, mx.array(tables, dtype=mx.int32)


def check(q, k, v, tables, lens, scale=None, op=None):
    """Kernel (``op``: `cpu.paged_decode` unless given) vs reference. The reference rounds
    dequantized rows to their float16 scales' dtype, the kernel keeps them in float32:
    quantized pools get float16's allowance."""
    scale = scale or q.shape[-1] ** -0.5  # or an AttentionSpec
    out = (op or cpu.paged_decode)(q, k, v, tables, lens, scale)
    ref = paged_attention_ref(q, k, v, tables, lens, scale)
    assert out.shape == ref.shape and out.dtype == q.dtype
    err = mx.abs(out.astype(mx.float32) - ref.astype(mx.float32)).max().item()
    quantized = isinstance(k, QuantizedBlocks) or isinstance(v, QuantizedBlocks)
    tol = max(TOLERANCE[q.dtype], TOLERANCE[mx.float16] if quantized else 0)
    assert err <= tol * max(1.0, mx.abs(ref).max().item()), err
    return out


CASES = [
    # lens, Hq, Hkv, D, bs
    ([5], 4, 4, 16, 4),
    ([17, 3, 33], 9, 3, 64, 16),  # GQA 3:1, ragged, partial last blocks
    ([64, 1], 8, 1, 32, 16),  # GQA 8:1, a one-token sequence
    ([16, 32], 2, 2, 128, 16),  # exact block multiples, D 128
    ([3, 200, 9, 150, 700, 20, 1], 4, 2, 16, 4),  # very ragged batch
    ([6000], 9, 3, 64, 16),  # one long sequence: split over both threads and merged
    ([600, 900], 32, 2, 64, 32),  # 16 query heads per KV head: two head chunks
]


@pytest.mark.parametrize("lens,Hq,Hkv,D,bs", CASES)
def test_matches_reference(lens, Hq, Hkv, D, bs):
    check(*make_case(lens, Hq, Hkv, D, bs, seed=len(lens) + D), lens)


@pytest.mark.parametrize("pool_dtype,q_dtype", [(mx.float16, mx.float32),
                                                (mx.bfloat16, mx.float32),
                                                (mx.float16, mx.float16),
                                                (mx.bfloat16, mx.bfloat16)])
def test_half_pools_and_queries(pool_dtype, q_dtype):
    lens = [37, 300, 5]
    check(*make_case(lens, 9, 3, 64, 16, seed=7, pool_dtype=pool_dtype, q_dtype=q_dtype), lens)


@pytest.mark.parametrize("k_quant,v_quant", [((8, 32), (8, 32)), ((4, 32), (4, 32)),
                                             ((8, 64), (4, 64)), ((4, 32), None)])
def test_quantized_pools(k_quant, v_quant):
    lens = [45, 260, 1]
    check(*make_case(lens, 9, 3, 64, 16, seed=11, k_quant=k_quant, v_quant=v_quant), lens)


# quantized rows dequantized in registers: other head dims, groups and GQA chunks, and a
# context long enough to be split over both threads
@pytest.mark.parametrize("lens,Hq,Hkv,D,k_quant,v_quant", [
    ([40, 130], 4, 2, 128, (8, 128), (4, 64)),
    ([600, 900], 32, 2, 64, (4, 64), (8, 32)),
    ([5000], 9, 3, 64, (8, 64), (8, 64)),
    ([77], 2, 2, 32, (4, 32), None),
])
def test_quantized_pools_of_other_shapes(lens, Hq, Hkv, D, k_quant, v_quant):
    check(*make_case(lens, Hq, Hkv, D, 16, seed=D + Hq, k_quant=k_quant, v_quant=v_quant), lens)


@pytest.mark.parametrize("quant", [None, (8, 64), (4, 32)])
def test_pools_as_stored_read_as_their_blocks(quant):
    """3-d pools (Hkv, blocks * size, .) with their block size (the layer stack's form: no
    reshape node) give the 4-d view's bits; a block size that does not divide them fails."""
    lens = [45, 260, 1]
    q, k, v, tables = make_case(lens, 9, 3, 64, 16, seed=13, k_quant=quant, v_quant=quant)
    ext, lens_a = build.require(), mx.array(lens, dtype=mx.int32)

    def flat(a):
        return a.reshape(a.shape[0], -1, a.shape[-1])

    def run(fold, **extra):
        kw = {}
        for name, x in (("k", k), ("v", v)):
            if isinstance(x, QuantizedBlocks):
                kw |= {f"{name}_scales": fold(x.scales), f"{name}_biases": fold(x.biases),
                       f"{name}_bits": x.quant.bits, f"{name}_group": x.quant.group_size}
            kw[name] = fold(x.data if isinstance(x, QuantizedBlocks) else x)
        return ext.paged_attention(q, block_tables=tables, context_lens=lens_a, scale=0.125,
                                   **kw, **extra)

    want = run(lambda a: a)
    np.testing.assert_array_equal(np.array(run(flat, block_size=16)), np.array(want))
    with pytest.raises(ValueError, match="block_size"):
        run(flat, block_size=12)
    with pytest.raises(ValueError, match="block_size"):
        run(flat)


def test_padding_blocks_are_never_read():
    lens = [9, 2]
    q, k, v, tables = make_case(lens, 4, 2, 16, 4, seed=3)
    out1 = cpu.paged_decode(q, k, v, tables, lens, 0.3)
    tables2 = np.array(tables)
    tables2[1, 1:] = 0  # other (valid) padding ids
    out2 = cpu.paged_decode(q, k, v, mx.array(tables2), lens, 0.3)
    np.testing.assert_array_equal(np.array(out1), np.array(out2))


@pytest.mark.parametrize("window", [0, 37])
def test_rows_outside_the_context_never_reach_a_score(window):
    """The kernel scores 16-row groups whole: rows of a group that lie past a sequence's
    length, or before its window, are computed and must never be used. NaN in them (a
    block's unwritten rows hold anything) leaves every output as it was, bit for bit, and
    verify rows (one sequence's consecutive positions) still equal each position alone."""
    bs, D = 16, 64
    lens = [45, 21, 58, 59, 60]  # the last three: one sequence's verify rows
    q, k, v, tables = make_case(lens[:2] + [60], 9, 3, D, bs, seed=21)
    tables = mx.concatenate([tables[:2], mx.repeat(tables[2:], 3, axis=0)])
    q = mx.random.normal((len(lens), 9, 1, D))
    k_np, v_np = np.array(k), np.array(v)
    # (table, the shortest context's length, the longest's) of each sequence
    for table, short, n in zip(np.array(tables)[[0, 1, 2]].tolist(), [45, 21, 58], [45, 21, 60],
                               strict=True):
        first = max(0, short - window) if window else 0  # the earliest key any row sees
        for pos in [*range(first // bs * bs, first), *range(n, -(-n // bs) * bs)]:
            k_np[:, table[pos // bs], pos % bs] = np.nan
            v_np[:, table[pos // bs], pos % bs] = np.nan
    ext, lens_a = build.require(), mx.array(lens, dtype=mx.int32)

    def run(k, v, qs=q, tb=tables, ls=lens_a):
        return np.array(ext.paged_attention(qs, k, v, tb, ls, scale=0.125, window=window))

    clean = run(k, v)
    poisoned = run(mx.array(k_np), mx.array(v_np))
    assert np.isfinite(poisoned).all()
    np.testing.assert_array_equal(poisoned, clean)
    for i in range(2, 5):  # each verify row alone: a plain decode of its position
        np.testing.assert_array_equal(
            run(mx.array(k_np), mx.array(v_np), q[i:i + 1], tables[i:i + 1], lens_a[i:i + 1])[0],
            poisoned[i])


def test_bad_inputs_raise_or_come_back_nan():
    q, k, v, tables = make_case([9], 2, 2, 16, 4, seed=4)
    with pytest.raises(ValueError, match="queries"):
        cpu.paged_decode(mx.concatenate([q, q], axis=2), k, v, tables, [9], 0.3)
    # an id outside the pool is never read: its sequence comes back as NaN
    out = cpu.paged_decode(q, k, v, mx.array([[0, 99, 1]], dtype=mx.int32), [9], 0.3)
    assert mx.isnan(out).all().item()
    out = cpu.paged_decode(q, k, v, tables, [13], 0.3)  # longer than its table
    assert mx.isnan(out).all().item()


def test_paged_attention_routes_cpu_decode():
    """Batches go to the extension; one sequence with plain pools of the queries' dtype
    stays on the reference (exactly mlx-lm's computation, the parity tests rely on it)."""
    lens = [40, 7]
    q, k, v, tables = make_case(lens, 9, 3, 64, 16, seed=5, pool_dtype=mx.float16)
    routed = paged_attention(q, k, v, tables, lens, 0.125)
    np.testing.assert_array_equal(np.array(routed),
                                  np.array(cpu.paged_decode(q, k, v, tables, lens, 0.125)))
    q1, k1, v1, t1 = make_case([40], 9, 3, 64, 16, seed=6)
    np.testing.assert_array_equal(np.array(paged_attention(q1, k1, v1, t1, [40], 0.125)),
                                  np.array(paged_attention_ref(q1, k1, v1, t1, [40], 0.125)))
    assert paged_attention(q, k, v, tables, lens, 0.125, use_kernels=False).shape == q.shape


def test_bad_first_launch_falls_back_once(monkeypatch):
    guard.GUARD.reset()
    monkeypatch.setattr(cpu, "paged_decode", lambda q, *a: mx.zeros_like(q) + 7)
    lens = [20, 9]
    q, k, v, tables = make_case(lens, 4, 2, 32, 8, seed=8, pool_dtype=mx.float16)
    ref = paged_attention_ref(q, k, v, tables, lens, 0.2)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(2):
            out = paged_attention(q, k, v, tables, lens, 0.2)
            np.testing.assert_array_equal(np.array(out), np.array(ref))
    assert len([w for w in seen if "attention kernels off" in str(w.message)]) == 1
    assert "first launch" in guard.kernel_fallback()
    guard.GUARD.reset()


def test_prefill_first_launch_is_checked_on_its_last_rows(monkeypatch):
    """The check's reference computes only the chunk's last `CHECK_ROWS` query rows (they
    see every key; a whole chunk's scores were a 1B model's first-prefill peak), and a
    kernel wrong there still falls back."""
    from engine.model.attention import dispatch, reference

    L, lens = 80, [100]
    _, k, v, tables = make_case(lens, 4, 2, 32, 8, seed=9, pool_dtype=mx.float16)
    q = mx.random.normal((1, 4, L, 32))
    real_ref, real_prefill, seen = reference.paged_attention_ref, cpu.paged_prefill, []
    monkeypatch.setattr(reference, "paged_attention_ref",
                        lambda *a, **kw: seen.append(a[0].shape) or real_ref(*a, **kw))
    guard.GUARD.reset()
    out = paged_attention(q, k, v, tables, lens, 0.2)
    assert seen == [(1, 4, dispatch.CHECK_ROWS, 32)] and guard.kernel_fallback() is None
    np.testing.assert_array_equal(np.array(out), np.array(real_prefill(q, k, v, tables,
                                                                       lens, 0.2)))
    full = real_ref(q, k, v, tables, lens, 0.2)
    assert mx.allclose(out, full, atol=2e-3).item()  # what the check samples, all rows hold

    guard.GUARD.reset()
    bad_last = mx.concatenate([mx.zeros((1, 4, L - 1, 32)), mx.full((1, 4, 1, 32), 7.0)], 2)
    monkeypatch.setattr(cpu, "paged_prefill", lambda q, *a, **kw: real_prefill(q, *a, **kw)
                        + bad_last)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = paged_attention(q, k, v, tables, lens, 0.2)
    assert any("attention kernels off" in str(w.message) for w in caught)
    assert "first launch" in guard.kernel_fallback()
    np.testing.assert_array_equal(np.array(out), np.array(real_ref(q, k, v, tables, lens,
                                                                   0.2)))
    guard.GUARD.reset()
