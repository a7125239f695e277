"""The extension's causal prefill attention (`cpu.paged_prefill`) against
`paged_attention_ref`, and its routing from `paged_attention` on CPU."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from test_cpu_ext_attention import check as check_kernel
from test_cpu_ext_attention import (
    ext,  # noqa: F401 - the module's autouse fixture
    make_case,
)

from engine.model.attention import cpu, paged_attention
from engine.model.attention.reference import paged_attention_ref


def prefill_case(lens, L, Hq, Hkv, D, bs, *, seed, q_dtype=mx.float32, **kw):
    """`make_case`'s scattered pools, with L queries per sequence."""
    _, k, v, tables = make_case(lens, Hq, Hkv, D, bs, seed=seed, q_dtype=q_dtype, **kw)
    q = mx.random.normal((len(lens), Hq, L, D), key=mx.random.key(seed)).astype(q_dtype)
    return q, k, v, tables


def check(q, k, v, tables, lens, scale=None):
    return check_kernel(q, k, v, tables, lens, scale, op=cpu.paged_prefill)


CASES = [
    # lens, L, Hq, Hkv, D, bs
    ([5], 5, 4, 4, 16, 4),  # the whole sequence is new: a plain causal square
    ([600], 512, 9, 3, 64, 16),  # the default model's chunk after a first one, partial block
    ([40, 33], 7, 9, 3, 64, 16),  # ragged batch, GQA 3:1, scattered blocks
    ([130], 130, 8, 1, 32, 16),  # GQA 8:1, 12 positions per tile
    ([70, 200], 64, 2, 2, 128, 16),  # D 128: two column passes of P.V
    ([100], 33, 4, 2, 48, 8),  # D 48: a 3-vector column pass; rows not a multiple of 4
    ([300], 100, 32, 2, 64, 32),  # 16 query heads per KV head: 6 positions per tile
    ([2], 2, 9, 3, 64, 16),  # shorter than a block
]


@pytest.mark.parametrize("lens,L,Hq,Hkv,D,bs", CASES)
def test_matches_reference(lens, L, Hq, Hkv, D, bs):
    check(*prefill_case(lens, L, Hq, Hkv, D, bs, seed=L + D), lens)


@pytest.mark.parametrize("pool_dtype,q_dtype", [(mx.float16, mx.float32),
                                                (mx.bfloat16, mx.float32),
                                                (mx.float16, mx.float16),
                                                (mx.bfloat16, mx.bfloat16)])
def test_half_pools_and_queries(pool_dtype, q_dtype):
    lens = [37, 300]
    check(*prefill_case(lens, 30, 9, 3, 64, 16, seed=7, pool_dtype=pool_dtype,
                        q_dtype=q_dtype), lens)


@pytest.mark.parametrize("k_quant,v_quant", [((8, 32), (8, 32)), ((4, 32), (4, 32)),
                                             ((8, 64), (4, 64)), ((4, 32), None)])
def test_quantized_pools(k_quant, v_quant):
    lens = [45, 260]
    check(*prefill_case(lens, 40, 9, 3, 64, 16, seed=11, k_quant=k_quant, v_quant=v_quant),
          lens)


# Decode rows that are one sequence's newest positions (speculative decoding verifying its
# drafts alone: one block table, consecutive lengths, at most 8) fold into the heads and
# run as one problem of the decode kernel (`one_sequence`): each folded head masks the keys
# past its own position, whichever partition of a split-K context holds them.
def rows_of(q, tables, lens, i):
    """Sequence i's L positions of prefill-shaped q as L decode rows of their own lengths."""
    L = q.shape[2]
    rows = q[i:i + 1].transpose(2, 1, 0, 3)  # (L, Hq, 1, D)
    return rows, mx.repeat(tables[i:i + 1], L, axis=0), [lens[i] - L + 1 + j for j in range(L)]


def check_rows(q, k, v, tables, lens, scale=None):
    for i in range(len(lens)):
        rows, tab, row_lens = rows_of(q, tables, lens, i)
        check_kernel(rows, k, v, tab, row_lens, scale)


FOLD_CASES = [
    ([1500], 2, 9, 3, 64, 16),  # one draft at a long context: split-K partitions
    ([1500, 700], 7, 9, 3, 64, 16),  # 21 folded heads per KV head: three head chunks
    ([900], 8, 32, 4, 128, 16),  # the most positions folded, D 128, 64 heads per KV head
    ([20, 3], 3, 4, 4, 16, 4),  # the general kernel (D 16); a sequence of its L only
    ([517], 5, 9, 3, 64, 16),  # the newest block partly filled, positions across two blocks
    ([301], 4, 9, 3, 64, 32),  # blocks of 32 rows, the newest one partly filled
    ([70], 6, 9, 3, 64, 8),  # blocks of 8 rows: one block a softmax step, no spans
]


@pytest.mark.parametrize("lens,L,Hq,Hkv,D,bs", FOLD_CASES)
def test_one_sequence_rows_fold_into_heads(lens, L, Hq, Hkv, D, bs):
    check_rows(*prefill_case(lens, L, Hq, Hkv, D, bs, seed=3 * L + D), lens)


@pytest.mark.parametrize("pool_dtype", [mx.float16, mx.bfloat16])
def test_one_sequence_rows_fold_on_half_pools(pool_dtype):
    lens = [1300, 45]
    check_rows(*prefill_case(lens, 7, 9, 3, 64, 16, seed=17, pool_dtype=pool_dtype), lens)


@pytest.mark.parametrize("k_quant,v_quant", [((8, 64), (8, 64)), ((4, 32), (4, 32)),
                                             ((8, 64), (4, 64))])
def test_one_sequence_rows_fold_on_quantized_pools(k_quant, v_quant):
    lens = [1200, 90]
    check_rows(*prefill_case(lens, 6, 9, 3, 64, 16, seed=13, k_quant=k_quant,
                             v_quant=v_quant), lens)


def test_one_sequence_rows_fold_with_sinks():
    from engine.model.attention import AttentionSpec

    lens = [1000, 40]
    q, k, v, tables = prefill_case(lens, 4, 8, 2, 64, 16, seed=21)
    sinks = 2.0 * mx.random.normal((8,), key=mx.random.key(5))
    check_rows(q, k, v, tables, lens, AttentionSpec(0.125, None, sinks))
    rows, tab, row_lens = rows_of(q, tables, lens, 1)  # 40 keys: the sinks weigh
    with_sinks = cpu.paged_decode(rows, k, v, tab, row_lens, AttentionSpec(0.125, None, sinks))
    plain = cpu.paged_decode(rows, k, v, tab, row_lens, 0.125)
    assert mx.abs(with_sinks - plain).max().item() > 1e-3  # the sinks took part


@pytest.mark.parametrize("k_quant", [None, (8, 64)])
def test_decode_rows_of_one_sequence_fold(k_quant):
    """Each folded row equals its own decode alone; rows that are not one sequence's (a gap
    in the lengths) keep the decode path, equal to the reference too."""
    n, rows = 1100, 5
    _, k, v, tables = make_case([n], 9, 3, 64, 16, seed=31, k_quant=k_quant, v_quant=k_quant)
    q = mx.random.normal((rows, 9, 1, 64), key=mx.random.key(32))
    tab = mx.repeat(tables, rows, axis=0)
    for lens in ([n - rows + 1 + i for i in range(rows)], [n - 6, n - 4, n - 3, n - 2, n]):
        out = check_kernel(q, k, v, tab, lens)
        for i in range(rows):  # each row is its own decode, whatever path ran
            one = cpu.paged_decode(q[i:i + 1], k, v, tables, [lens[i]], 0.125)
            np.testing.assert_allclose(np.array(out[i:i + 1]), np.array(one), atol=2e-6)


def test_short_prefill_chunks_round_as_cold_prefill():
    """A prompt's tail after a cached prefix (a few positions) is never folded: the prefill
    kernel gives its positions bit for bit what the whole prefill gave them."""
    lens, L = [600], 6
    q, k, v, tables = prefill_case(lens, 64, 9, 3, 64, 16, seed=41)
    whole = cpu.paged_prefill(q, k, v, tables, lens, 0.125)
    tail = cpu.paged_prefill(q[:, :, -L:], k, v, tables, lens, 0.125)
    np.testing.assert_array_equal(np.array(tail), np.array(whole[:, :, -L:]))


def test_bad_inputs_come_back_nan():
    q, k, v, tables = prefill_case([9], 4, 2, 2, 16, 4, seed=4)
    out = cpu.paged_prefill(q, k, v, mx.array([[0, 99, 1]], dtype=mx.int32), [9], 0.3)
    assert mx.isnan(out).all().item()  # an id outside the pool is never read
    assert mx.isnan(cpu.paged_prefill(q, k, v, tables, [13], 0.3)).all().item()  # > table
    assert mx.isnan(cpu.paged_prefill(q, k, v, tables, [3], 0.3)).all().item()  # < L


def test_paged_attention_routes_cpu_prefill():
    """The extension path's float16 pools with float32 queries go to the extension; one
    sequence with plain pools of the queries' dtype stays on the reference (mlx-lm's exact
    computation, which the float32 parity tests rely on)."""
    lens = [300]
    q, k, v, tables = prefill_case(lens, 50, 9, 3, 64, 16, seed=5, pool_dtype=mx.float16)
    np.testing.assert_array_equal(np.array(paged_attention(q, k, v, tables, lens, 0.125)),
                                  np.array(cpu.paged_prefill(q, k, v, tables, lens, 0.125)))
    q1, k1, v1, t1 = prefill_case(lens, 50, 9, 3, 64, 16, seed=6)
    np.testing.assert_array_equal(np.array(paged_attention(q1, k1, v1, t1, lens, 0.125)),
                                  np.array(paged_attention_ref(q1, k1, v1, t1, lens, 0.125)))
