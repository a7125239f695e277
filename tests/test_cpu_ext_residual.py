"""The extension's attention over a residual pool (`attention/cpu_residual.py`): decode
against a float64 oracle of the same rule (a row's own block exact where the residual map
holds it, every other block its stored quantized bytes), a verify step's rows, batch
invariance, bad block ids, the routing; prefill chunks against the same oracle (each
query as a decode row at its position), cut every way and bit for bit alike however cut."""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest
from test_cpu_ext_attention import ext  # noqa: F401 - the module's autouse fixture

from engine.kvcache import rotation
from engine.kvcache.kv_cache import KVLayout
from engine.kvcache.quant import QuantSpec
from engine.kvcache.residual import ResidualKVCache
from engine.model.attention import cpu_residual, guard, paged_attention, residual, routes
from engine.model.attention.spec import AttentionSpec, PagedCall

BS = 16


def make_pool(lens, k_bits, v_bits, rot, *, Hkv=3, D=64, v_group=64, seed=0):
    """A residual pool holding each sequence on shuffled blocks, written as a prompt and
    then one decode row (the step a decode query runs in); keys with outlier channels."""
    layout = KVLayout(1, Hkv, D, BS, mx.float16, QuantSpec(k_bits, 64, rot),
                      QuantSpec(v_bits, v_group, rot), residual=True, key_channel=True)
    need = [-(-n // BS) for n in lens]
    ids = list(range(sum(need) + 3))
    random.Random(seed).shuffle(ids)
    kv = ResidualKVCache(layout, len(ids))
    rng = np.random.default_rng(seed)
    tables, last = [], []
    for n, nb in zip(lens, need, strict=True):
        table, ids = ids[:nb], ids[nb:]
        tables.append(table + [table[0]] * (max(need) - nb))
        k = rng.standard_normal((Hkv, n, D)) * np.where(np.arange(D) % 13 == 0, 20.0, 1.0)
        v = rng.standard_normal((Hkv, n, D))
        slots = mx.array([table[i // BS] * BS + i % BS for i in range(n)], dtype=mx.int32)
        rows = (mx.array(k.astype(np.float16)), mx.array(v.astype(np.float16)))
        kv.write(0, slots[:-1], rows[0][:, :-1], rows[1][:, :-1])
        last.append((slots[-1:], rows[0][:, -1:], rows[1][:, -1:]))
    # every sequence's decode row in one write, as one batched step writes them
    kv.write(0, mx.concatenate([s for s, _, _ in last]),
             mx.concatenate([k for _, k, _ in last], axis=1),
             mx.concatenate([v for _, _, v in last], axis=1))
    mx.eval(kv.keys, kv.values, kv.res_keys, kv.res_values)
    return kv, mx.array(tables, dtype=mx.int32)


def oracle(q, kv: ResidualKVCache, table, lens, scale, sinks=None, window=None) -> np.ndarray:
    """The rule in float64 from the stored bytes (a window: the last ``window`` keys)."""
    L = kv.layout
    H, D = L.num_kv_heads, L.head_dim
    kp, vp = kv.block_view(0)
    R = np.array(rotation._matrix(D), dtype=np.float64)
    codes, ks, kb = (np.array(a) for a in kv.keys[0])
    if L.k_quant.bits == 4:
        codes = np.stack([codes & 15, codes >> 4], axis=-1).reshape(*codes.shape[:-1], -1)
    kq = codes * ks.astype(np.float64)[..., None] + kb.astype(np.float64)[..., None]
    kq = kq.swapaxes(-1, -2)  # (H, nb, BS, D)
    v = vp.quantized  # float32 scales and biases: the float16 ones would round the rows
    vq = np.array(mx.dequantize(v.data, v.scales.astype(mx.float32), v.biases.astype(mx.float32),
                                group_size=v.quant.group_size, bits=v.quant.bits), np.float64)
    if L.k_quant.rotation:
        kq = kq @ R.T
    if L.v_quant.rotation:
        vq = vq @ R.T
    res_k = np.array(kp.residual, dtype=np.float64)
    res_v = np.array(vp.residual, dtype=np.float64)
    res_map = np.array(kp.res_map)
    qn = np.array(q.astype(mx.float32), dtype=np.float64)
    out = np.zeros(qn.shape)
    group = qn.shape[1] // H
    for b, n in enumerate(lens):
        blocks = np.array(table[b])[:-(-n // BS)]
        own = len(blocks) - 1  # the only block read exact (where mapped): the rule by position
        keys = np.concatenate([res_k[:, res_map[i]] if res_map[i] >= 0 and j == own
                               else kq[:, i] for j, i in enumerate(blocks)], axis=1)[:, :n]
        values = np.concatenate([res_v[:, res_map[i]] if res_map[i] >= 0 and j == own
                                 else vq[:, i] for j, i in enumerate(blocks)], axis=1)[:, :n]
        if window is not None:
            keys, values = keys[:, max(0, n - window):], values[:, max(0, n - window):]
        for hq in range(qn.shape[1]):
            s = keys[hq // group] @ qn[b, hq, 0] * scale
            m = s.max() if sinks is None else max(s.max(), float(sinks[hq]))
            e = np.exp(s - m)
            z = e.sum() + (0.0 if sinks is None else np.exp(float(sinks[hq]) - m))
            out[b, hq, 0] = e @ values[hq // group] / z
    return out


def run(q, kv, table, lens, scale, sinks=None, window=None):
    kp, vp = kv.block_view(0)
    return cpu_residual.launch(q, kp, vp, table, lens,
                                     AttentionSpec(scale, window, sinks=sinks))


def check(out: mx.array, want: np.ndarray, tol: float) -> None:
    got = np.array(out.astype(mx.float32), dtype=np.float64)
    err = np.abs(got - want).max()
    assert err <= tol * max(1.0, np.abs(want).max()), err


# lens: one inside its first block, one whose decode row just filled a block (still read
# exact in this step), one mid-block, one long enough to split into partitions
LENS = [5, 32, 37, 1100]


@pytest.mark.parametrize("k_bits,v_bits,rot", [(8, 8, 1), (8, 4, 1), (4, 4, 1), (4, 4, 0),
                                                (8, 8, 0), (4, 8, 1)])
def test_formats_match_the_float64_rule(k_bits, v_bits, rot):
    kv, table = make_pool(LENS, k_bits, v_bits, rot, seed=k_bits + v_bits + rot)
    q = mx.random.normal((len(LENS), 9, 1, 64), key=mx.random.key(1))
    check(run(q, kv, table, LENS, 0.125), oracle(q, kv, table, LENS, 0.125), 5e-5)


@pytest.mark.parametrize("Hq,Hkv,D,v_group", [(8, 1, 128, 32), (12, 1, 128, 64), (4, 2, 64, 32)])
def test_head_dims_groups_and_float16_queries(Hq, Hkv, D, v_group):
    lens = [20, 300]
    kv, table = make_pool(lens, 4, 4, 1, Hkv=Hkv, D=D, v_group=v_group, seed=D + Hq)
    q = mx.random.normal((2, Hq, 1, D), key=mx.random.key(2)).astype(mx.float16)
    out = run(q, kv, table, lens, D ** -0.5)
    assert out.dtype == mx.float16
    check(out, oracle(q, kv, table, lens, D ** -0.5), 2e-3)


def test_sinks_join_the_softmax():
    kv, table = make_pool(LENS, 8, 4, 1, seed=5)
    q = mx.random.normal((len(LENS), 9, 1, 64), key=mx.random.key(3))
    sinks = mx.array(np.linspace(-2.0, 6.0, 9).astype(np.float32))
    check(run(q, kv, table, LENS, 0.125, sinks), oracle(q, kv, table, LENS, 0.125, sinks), 5e-5)


@pytest.mark.parametrize("window", [1, 16, 20, 37, 100, 700])
def test_sliding_windows_read_only_their_last_positions(window):
    """Windows inside a block, on a block's edge, longer than some contexts, and across
    the partitions of the long one; with sinks, as gpt-oss's windowed layers have them."""
    kv, table = make_pool(LENS, 4, 8, 1, seed=window)
    q = mx.random.normal((len(LENS), 9, 1, 64), key=mx.random.key(window))
    want = oracle(q, kv, table, LENS, 0.125, window=window)
    check(run(q, kv, table, LENS, 0.125, window=window), want, 5e-5)
    assert not np.allclose(want, oracle(q, kv, table, LENS, 0.125), atol=1e-3)  # it matters
    sinks = mx.array(np.linspace(-2.0, 6.0, 9).astype(np.float32))
    check(run(q, kv, table, LENS, 0.125, sinks, window),
          oracle(q, kv, table, LENS, 0.125, sinks, window), 5e-5)


def test_a_row_computes_alike_alone_and_in_any_batch():
    kv, table = make_pool(LENS, 4, 4, 1, seed=6)
    q = mx.random.normal((len(LENS), 9, 1, 64), key=mx.random.key(4))
    batched = run(q, kv, table, LENS, 0.125)
    for b, n in enumerate(LENS):
        alone = run(q[b:b + 1], kv, table[b:b + 1], [n], 0.125)
        assert mx.array_equal(alone, batched[b:b + 1]).item()


def test_verify_rows_read_a_block_filled_this_step_quantized():
    """A verify step's rows are one sequence's decode rows (lengths 16 and 17 here): the
    step's write fills block 0, which stays mapped for its own row, but the next row reads
    it quantized, as plain decoding does a step later. The op and the reference agree."""
    layout = KVLayout(1, 3, 64, BS, mx.float16, QuantSpec(4, 64, 1),
                      QuantSpec(4, 64, 1), residual=True, key_channel=True)
    kv = ResidualKVCache(layout, 4)
    rng = np.random.default_rng(9)
    k, v = (mx.array((rng.standard_normal((3, 17, 64)) * 3).astype(np.float16))
            for _ in range(2))
    slots = mx.array([2 * BS + i for i in range(16)] + [BS], dtype=mx.int32)  # blocks 2, 1
    kv.write(0, slots[:15], k[:, :15], v[:, :15])
    kv.write(0, slots[15:], k[:, 15:], v[:, 15:])  # one step: fills block 2, starts block 1
    kp, vp = kv.block_view(0)
    assert np.array(kp.res_map)[[2, 1]].min() >= 0  # block 2 still mapped in its step
    table = mx.array([[2, 1], [2, 1]], dtype=mx.int32)
    q = mx.random.normal((2, 9, 1, 64), key=mx.random.key(7))
    want = oracle(q, kv, table, [16, 17], 0.125)
    check(cpu_residual.launch(q, kp, vp, table, [16, 17], AttentionSpec(0.125)), want,
          5e-5)
    ref = residual.residual_attention(PagedCall(q, kp, vp, table, (16, 17), AttentionSpec(0.125)))
    check(ref, want, 1e-3)
    # the second row reads what it reads a step later, when block 2 is no longer mapped
    kv.write(0, mx.array([BS + 1], dtype=mx.int32), k[:, :1], v[:, :1])
    kp2, vp2 = kv.block_view(0)
    assert int(np.array(kp2.res_map)[2]) == -1
    step_later = cpu_residual.launch(q[1:], kp2, vp2, table[1:], [17], AttentionSpec(0.125))
    assert mx.array_equal(step_later, cpu_residual.launch(
        q[1:], kp, vp, table[1:], [17], AttentionSpec(0.125))).item()


def test_a_bad_block_id_poisons_its_sequence_only():
    kv, table = make_pool([40, 40], 8, 8, 1, seed=7)
    bad = mx.array([[int(table[0, 0]), 10_000, int(table[0, 2])], table[1].tolist()],
                   dtype=mx.int32)
    q = mx.random.normal((2, 9, 1, 64), key=mx.random.key(5))
    out = run(q, kv, bad, [40, 40], 0.125)
    assert mx.all(mx.isnan(out[0])).item() and not mx.any(mx.isnan(out[1])).item()
    check(out[1:], oracle(q[1:], kv, table[1:], [40], 0.125), 5e-5)


def test_decode_routes_to_the_op_and_the_dispatcher_runs_it():
    kv, table = make_pool(LENS, 4, 4, 1, seed=8)
    kp, vp = kv.block_view(0)
    q = mx.random.normal((len(LENS), 9, 1, 64), key=mx.random.key(6))
    call = PagedCall(q, kp, vp, table, tuple(LENS), AttentionSpec(0.125))
    assert routes.route(call, "cpu").path == "cpu_residual" and cpu_residual.supports(call)
    for backend in ("metal", "cuda"):  # the GPU kernel (tests/test_kernels_residual.py)
        assert routes.route(call, backend).path == "gpu_residual"
    chunk = PagedCall(mx.zeros((1, 9, 4, 64)), kp, vp, table[:1], (5,), AttentionSpec(0.125))
    assert routes.route(chunk, "cpu").path == "cpu_residual" and cpu_residual.supports(chunk)
    out = paged_attention(q, kp, vp, table, LENS, 0.125)  # first launch: checked, then kept
    assert guard.kernel_fallback() is None
    assert mx.array_equal(out, run(q, kv, table, LENS, 0.125)).item()


@pytest.mark.parametrize("k_bits,v_bits,window", [(4, 4, None), (8, 4, None), (4, 4, 24),
                                                  (8, 4, 70)])
def test_prefill_chunks_match_the_float64_rule_however_cut(k_bits, v_bits, window):
    """Chunks starting and ending inside blocks, across many blocks, and one inside a block:
    each query reads the blocks before its own quantized and its own exact, held to the
    float64 rule at each query's position (a decode row there). (`residual.residual_attention`
    rounds its dequantized rows to float16 first: up to ~2e-2 off on these outlier keys.)"""
    layout = KVLayout(1, 3, 64, BS, mx.float16, QuantSpec(k_bits, 64, 1),
                      QuantSpec(v_bits, 64, 1), residual=True, key_channel=True)
    kv = ResidualKVCache(layout, 24)
    ids = list(range(24))
    random.Random(k_bits).shuffle(ids)
    table = mx.array([ids[:20]], dtype=mx.int32)
    rng = np.random.default_rng(k_bits + v_bits)
    n = 300
    k = rng.standard_normal((3, n, 64)) * np.where(np.arange(64) % 13 == 0, 20.0, 1.0)
    v = rng.standard_normal((3, n, 64))
    q = mx.array(rng.standard_normal((1, 9, n, 64)).astype(np.float32))
    done = 0
    for cut in (37, 40, 100, 250, 300):
        slots = mx.array([ids[i // BS] * BS + i % BS for i in range(done, cut)], dtype=mx.int32)
        kv.write(0, slots, mx.array(k[:, done:cut].astype(np.float16)),
                 mx.array(v[:, done:cut].astype(np.float16)))
        call = PagedCall(q[:, :, done:cut], *kv.block_view(0), table, (cut,),
                         AttentionSpec(0.125, window))
        assert cpu_residual.supports(call)
        out = cpu_residual.launch(*call.args())
        assert out.shape == (1, 9, cut - done, 64)
        rows = q[:, :, done:cut].transpose(2, 1, 0, 3)  # each query as a decode row
        want = oracle(rows, kv, mx.repeat(table, cut - done, axis=0),
                      list(range(done + 1, cut + 1)), 0.125, window=window)
        check(out.transpose(2, 1, 0, 3), want, 5e-5)
        done = cut


def test_a_prefill_query_computes_alike_however_its_prompt_is_cut():
    """A cached prompt's tail must equal a cold prefill's rows: the same positions through
    chunks cut at other places give the same bits, and a bad block id gives NaN."""
    layout = KVLayout(1, 3, 64, BS, mx.float16, QuantSpec(4, 64, 1), QuantSpec(4, 64, 1),
                      residual=True, key_channel=True)
    rng = np.random.default_rng(3)
    n = 90
    k = rng.standard_normal((3, n, 64)).astype(np.float16)
    v = rng.standard_normal((3, n, 64)).astype(np.float16)
    q = mx.array(rng.standard_normal((1, 9, n, 64)).astype(np.float32))
    table = mx.array([list(range(6))], dtype=mx.int32)
    outs = []
    for cuts in ((90,), (32, 80, 90), (17, 64, 75, 90)):
        kv = ResidualKVCache(layout, 8)
        parts, done = [], 0
        for cut in cuts:
            kv.write(0, mx.arange(done, cut, dtype=mx.int32), mx.array(k[:, done:cut]),
                     mx.array(v[:, done:cut]))
            parts.append(cpu_residual.launch(q[:, :, done:cut], *kv.block_view(0), table,
                                             [cut], AttentionSpec(0.125)))
            done = cut
        outs.append(mx.concatenate(parts, axis=2))
    assert mx.array_equal(outs[0], outs[1]).item() and mx.array_equal(outs[0], outs[2]).item()
    bad = mx.array([[0, 1, 2, 3, 4, 10_000]], dtype=mx.int32)
    out = cpu_residual.launch(q[:, :, 80:], *kv.block_view(0), bad, [90], AttentionSpec(0.125))
    assert mx.all(mx.isnan(out)).item()


def test_stores_as_kept_read_as_their_blocks():
    """The layer stack passes the per-row stores 3-d as kept, (H, blocks * BS, .), with the
    block size, so no reshape node stands between a write and the op: same bits as the
    4-d views; a store whose rows do not fill whole blocks is refused."""
    kv, table = make_pool(LENS, 4, 4, 1, seed=3)
    kp, vp = kv.block_view(0)
    q = mx.random.normal((len(LENS), 9, 1, 64), key=mx.random.key(8))
    kq, vq = kp.quantized, vp.quantized
    op = cpu_residual.build.require().paged_residual

    def call(block_size, flat, **kw):
        def view(a):
            return a.reshape(a.shape[0], -1, a.shape[-1]) if flat else a
        return op(
            q, kq.data, kq.scales, kq.biases, view(vq.data), view(vq.scales), view(vq.biases),
            view(kw.get("res_k", kp.residual)), view(kp.residual if "res_k" in kw
                                                     else vp.residual),
            kp.res_map.astype(mx.int32), table, mx.array(LENS, dtype=mx.int32), scale=0.125,
            k_bits=4, v_bits=4, v_group=64, rotation=rotation.signs(64), rotate_k=True,
            rotate_v=True, block_size=block_size)

    assert mx.array_equal(call(BS, True), call(0, False)).item()
    check(call(BS, True), oracle(q, kv, table, LENS, 0.125), 5e-5)
    with pytest.raises(ValueError, match="other stores 3-d"):
        call(BS, False)  # 4-d views where 3-d stores are declared
    short = kp.residual.reshape(3, -1, 64)[:, :-1]  # one row short of whole blocks
    with pytest.raises(ValueError, match="res_k and res_v"):
        call(BS, True, res_k=short)
