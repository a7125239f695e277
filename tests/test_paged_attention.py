"""Reference paged attention vs dense attention over the same K/V."""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest

from engine.model.attention import AttentionSpec, paged_attention
from engine.model.attention.reference import causal_mask, length_groups, paged_attention_ref


def dense_attention(q, k, v, scale, window=None, sinks=None):
    """Plain softmax attention in float64 numpy: q (Hq, L, D), k/v (Hkv, T, D), causal;
    ``window``: each query sees its last ``window`` positions; ``sinks`` (Hq,): a logit
    per head in each softmax's denominator, with no value."""
    Hq, L, D = q.shape
    Hkv, T, _ = k.shape
    g = Hq // Hkv
    out = np.zeros((Hq, L, D))
    for h in range(Hq):
        s = (q[h] @ k[h // g].T) * scale  # (L, T)
        for i in range(L):
            pos = T - L + i
            s[i, pos + 1 :] = -np.inf
            if window is not None:
                s[i, : max(0, pos - window + 1)] = -np.inf
        m = s.max(-1, keepdims=True)
        if sinks is not None:
            m = np.maximum(m, sinks[h])
        p = np.exp(s - m)
        denom = p.sum(-1, keepdims=True) + (np.exp(sinks[h] - m) if sinks is not None else 0)
        out[h] = (p / denom) @ v[h // g]
    return out


def make_case(lens, L, Hq, Hkv, D, bs, num_blocks, seed, dtype=mx.float32):
    rng = random.Random(seed)
    nrng = np.random.default_rng(seed)
    k_pool = nrng.standard_normal((Hkv, num_blocks, bs, D)).astype(np.float32)
    v_pool = nrng.standard_normal((Hkv, num_blocks, bs, D)).astype(np.float32)
    ids = list(range(num_blocks))
    rng.shuffle(ids)  # scattered, non-contiguous blocks
    max_blocks = max(-(-n // bs) for n in lens)
    tables, start = [], 0
    for n in lens:
        nb = -(-n // bs)
        own = ids[start : start + nb]
        start += nb
        tables.append(own + [ids[0]] * (max_blocks - nb))  # padding: a valid id
    q = nrng.standard_normal((len(lens), Hq, L, D)).astype(np.float32)
    return q, k_pool, v_pool, np.array(tables, dtype=np.int32)


CASES = [
    # lens, L, Hq, Hkv, D, bs
    ([5], 1, 4, 4, 16, 4),
    ([17, 3, 33], 1, 9, 3, 64, 16),  # GQA 3:1, ragged, partial last blocks
    ([64, 1], 1, 8, 1, 32, 16),  # GQA 8:1, a one-token sequence
    ([40], 7, 6, 2, 32, 8),  # chunked prefill: 7 new tokens after 33 cached
    ([40, 12], 5, 4, 2, 16, 4),  # batched chunk, ragged
    ([16, 32], 16, 2, 2, 8, 16),  # exact block multiples
    ([3, 200, 9, 150, 700, 20, 1], 1, 4, 2, 16, 4),  # very ragged decode: length groups
]


@pytest.mark.parametrize("lens,L,Hq,Hkv,D,bs", CASES)
def test_matches_dense_attention(lens, L, Hq, Hkv, D, bs):
    num_blocks = sum(-(-n // bs) for n in lens) + 3
    q, kp, vp, tables = make_case(lens, L, Hq, Hkv, D, bs, num_blocks, seed=len(lens) * L)
    scale = D**-0.5
    out = paged_attention_ref(mx.array(q), mx.array(kp), mx.array(vp), mx.array(tables),
                              lens, scale)
    assert out.shape == (len(lens), Hq, L, D)
    for b, n in enumerate(lens):
        nb = -(-n // bs)
        k = np.concatenate([kp[:, t] for t in tables[b, :nb]], axis=1)[:, :n]
        v = np.concatenate([vp[:, t] for t in tables[b, :nb]], axis=1)[:, :n]
        ref = dense_attention(q[b].astype(np.float64), k, v, scale)
        np.testing.assert_allclose(np.array(out[b]), ref, atol=2e-5, rtol=1e-4)


def test_padding_blocks_are_never_read():
    lens, bs = [9, 2], 4
    q, kp, vp, tables = make_case(lens, 1, 2, 2, 8, bs, 8, seed=3)
    out1 = paged_attention_ref(mx.array(q), mx.array(kp), mx.array(vp), mx.array(tables), lens, 1)
    tables2 = tables.copy()
    tables2[1, 1:] = 7  # different padding ids
    kp2, vp2 = kp.copy(), vp.copy()
    used = {int(t) for b, n in enumerate(lens) for t in tables[b, : -(-n // bs)]}
    for blk in set(range(8)) - used:
        kp2[:, blk] = np.nan  # poison every block no sequence owns
        vp2[:, blk] = np.nan
    out2 = paged_attention_ref(mx.array(q), mx.array(kp2), mx.array(vp2), mx.array(tables2),
                               lens, 1)
    np.testing.assert_array_equal(np.array(out1), np.array(out2))


def test_dispatch_uses_reference_on_cpu():
    lens = [6]
    q, kp, vp, tables = make_case(lens, 1, 2, 1, 8, 4, 4, seed=1)
    args = (mx.array(q), mx.array(kp), mx.array(vp), mx.array(tables), lens, 0.3)
    np.testing.assert_array_equal(np.array(paged_attention(*args)),
                                  np.array(paged_attention_ref(*args)))


def test_float16_pool_with_float32_queries():
    lens = [21]
    q, kp, vp, tables = make_case(lens, 1, 4, 2, 16, 8, 4, seed=2)
    out = paged_attention_ref(mx.array(q), mx.array(kp).astype(mx.float16),
                              mx.array(vp).astype(mx.float16), mx.array(tables), lens, 0.25)
    assert out.dtype == mx.float32
    k = np.concatenate([kp[:, t] for t in tables[0, :3]], axis=1)[:, :21]
    v = np.concatenate([vp[:, t] for t in tables[0, :3]], axis=1)[:, :21]
    ref = dense_attention(q[0].astype(np.float64), k, v, 0.25)
    np.testing.assert_allclose(np.array(out[0]), ref, atol=5e-3)


@pytest.mark.parametrize("L", [1, 5])
def test_contiguous_run_view_equals_gather(L):
    from engine.model.attention import contiguous_run

    bs, n, run = 4, 11, 2
    nrng = np.random.default_rng(5)
    kp = mx.array(nrng.standard_normal((2, 8, bs, 16)).astype(np.float32))
    vp = mx.array(nrng.standard_normal((2, 8, bs, 16)).astype(np.float32))
    q = mx.array(nrng.standard_normal((1, 4, L, 16)).astype(np.float32))
    table = [run, run + 1, run + 2]
    assert contiguous_run(table) == run
    assert contiguous_run([3, 5]) is None and contiguous_run([]) is None
    tables = mx.array([table], dtype=mx.int32)
    gathered = paged_attention_ref(q, kp, vp, tables, [n], 0.25)
    viewed = paged_attention_ref(q, kp, vp, tables, [n], 0.25, block_run=run)
    np.testing.assert_array_equal(np.array(gathered), np.array(viewed))


def test_length_groups_bound_the_padding():
    lens = [3, 200, 9, 150, 700, 20, 1]
    groups = length_groups(lens, 4)
    assert sorted(i for g in groups for i in g) == list(range(len(lens)))
    assert [[lens[i] for i in g] for g in groups] == [[1, 3, 9, 20], [150, 200], [700]]
    assert length_groups([40, 44, 60], 16) == [[0, 1, 2]]  # similar lengths: one batch


def _dense_of(q, kp, vp, tables, lens, bs, b, **kw):
    nb = -(-lens[b] // bs)
    k = np.concatenate([kp[:, t] for t in tables[b, :nb]], axis=1)[:, :lens[b]]
    v = np.concatenate([vp[:, t] for t in tables[b, :nb]], axis=1)[:, :lens[b]]
    return dense_attention(q[b].astype(np.float64), k, v, **kw)


@pytest.mark.parametrize("window", [1, 3, 16, 1000])
@pytest.mark.parametrize("lens,L,Hq,Hkv,D,bs", CASES)
def test_sliding_window_matches_dense(lens, L, Hq, Hkv, D, bs, window):
    """A layer with a window sees only its last W positions: decode, prefill chunks,
    batched multi-token calls and ragged batches alike."""
    num_blocks = sum(-(-n // bs) for n in lens) + 3
    q, kp, vp, tables = make_case(lens, L, Hq, Hkv, D, bs, num_blocks, seed=window + L)
    spec = AttentionSpec(D**-0.5, window=window)
    out = paged_attention(mx.array(q), mx.array(kp), mx.array(vp), mx.array(tables), lens,
                          spec)
    for b in range(len(lens)):
        ref = _dense_of(q, kp, vp, tables, lens, bs, b, scale=spec.scale, window=window)
        np.testing.assert_allclose(np.array(out[b]), ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("L", [1, 6])
def test_window_over_a_contiguous_run_reads_only_the_window(L):
    """The view path cuts the run to the window; poisoned rows before it are never read."""
    bs, n, run, window = 4, 23, 1, 5
    nrng = np.random.default_rng(9)
    kp = nrng.standard_normal((2, 9, bs, 16)).astype(np.float32)
    vp = nrng.standard_normal((2, 9, bs, 16)).astype(np.float32)
    q = nrng.standard_normal((1, 4, L, 16)).astype(np.float32)
    table = np.array([list(range(run, run + 6))], dtype=np.int32)
    ref = _dense_of(q, kp, vp, table, [n], bs, 0, scale=0.25, window=window)
    first_seen = n - L - window + 1
    for pool in (kp, vp):  # poison the run's rows before the first one any query sees
        rows = pool[:, run:].reshape(2, -1, 16)
        assert np.shares_memory(rows, pool)
        rows[:, :first_seen] = np.nan
    spec = AttentionSpec(0.25, window=window)
    out = paged_attention_ref(mx.array(q), mx.array(kp), mx.array(vp), mx.array(table), [n],
                              spec, block_run=run)
    np.testing.assert_allclose(np.array(out[0]), ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("lens,L,Hq,Hkv,D,bs", CASES[:5])
def test_attention_sinks_match_dense(lens, L, Hq, Hkv, D, bs):
    num_blocks = sum(-(-n // bs) for n in lens) + 3
    q, kp, vp, tables = make_case(lens, L, Hq, Hkv, D, bs, num_blocks, seed=11)
    sinks = np.random.default_rng(4).standard_normal(Hq).astype(np.float32) * 2
    spec = AttentionSpec(D**-0.5, window=None, sinks=mx.array(sinks))
    out = paged_attention(mx.array(q), mx.array(kp), mx.array(vp), mx.array(tables), lens,
                          spec)
    for b in range(len(lens)):
        ref = _dense_of(q, kp, vp, tables, lens, bs, b, scale=spec.scale, sinks=sinks)
        np.testing.assert_allclose(np.array(out[b]), ref, atol=2e-5, rtol=1e-4)
    plain = paged_attention_ref(mx.array(q), mx.array(kp), mx.array(vp), mx.array(tables),
                                lens, spec.scale)
    assert not np.allclose(np.array(out), np.array(plain))  # the sinks did take mass


@pytest.mark.parametrize(("n", "L", "window"), [(10, 1, 4), (10, 10, 4), (40, 7, 16)])
def test_window_mask_is_mlx_lms(n, L, window):
    from mlx_lm.models.base import create_causal_mask

    ours = causal_mask([n], L, n, window)[0, 0]
    assert mx.array_equal(ours, create_causal_mask(L, n - L, window_size=window))


def test_a_window_must_be_positive():
    with pytest.raises(ValueError, match="window"):
        AttentionSpec(0.1, window=0)


class HalfRows:
    """A stand-in for a new stored KV format: float16 rows behind `PoolFormat`'s gather/run."""

    def __init__(self, pool: mx.array):
        self.rows = pool.astype(mx.float16)

    @property
    def shape(self):
        return self.rows.shape

    def gather(self, table):
        return self.rows[:, table]

    def run(self, start, stop):
        H, _, _, D = self.rows.shape
        return self.rows.reshape(H, -1, D)[:, start:stop]


@pytest.mark.parametrize(("lens", "L", "block_run"), [([17, 3, 33], 1, None), ([40], 7, None),
                                                      ([11], 1, 0), ([11], 5, 0)])
def test_a_new_pool_format_needs_no_change_to_the_dispatcher(lens, L, block_run):
    """Kernels decline a format they do not know; the reference reads it through
    gather/run, so decode, prefill and the view path all work on it at once."""
    bs = 4
    num_blocks = sum(-(-n // bs) for n in lens) + 3
    q, kp, vp, tables = make_case(lens, L, 4, 2, 16, bs, num_blocks, seed=L)
    if block_run is not None:
        tables = np.arange(block_run, block_run + tables.shape[1], dtype=np.int32)[None]
    k, v = mx.array(kp), mx.array(vp)
    args = (mx.array(tables), lens, 0.25)
    out = paged_attention(mx.array(q), HalfRows(k), HalfRows(v), *args, block_run=block_run)
    expected = paged_attention_ref(mx.array(q), k.astype(mx.float16), v.astype(mx.float16),
                                   *args, block_run=block_run)
    np.testing.assert_array_equal(np.array(out), np.array(expected))
