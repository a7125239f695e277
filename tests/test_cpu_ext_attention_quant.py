"""The extension's decode attention over quantized pools (integer key scores and p * s value
accumulation, csrc/paged_decode_qk.h) against `paged_attention_ref`: every bit width and
group, head dims 64 and 128, GQA groups 1-8 (the specialized task) and 9 (the general one),
block sizes that are and are not multiples of 16, windows that start inside a block, sinks,
and a quantized side next to a float one."""

from __future__ import annotations

import mlx.core as mx
import pytest
from test_cpu_ext_attention import (
    check,
    ext,  # noqa: F401 - the module's autouse fixture
    make_case,
    quantize_pool,
)
from test_cpu_ext_window_sinks import spec_of

from engine.kvcache.quantized_blocks import QuantizedBlocks
from engine.model.attention import AttentionSpec, cpu
from engine.model.attention.reference import paged_attention_ref


@pytest.mark.parametrize("k_quant,v_quant", [((8, 64), (8, 64)), ((8, 32), (4, 32)),
                                             ((4, 64), (4, 64)), ((4, 32), (8, 32)),
                                             ((8, 64), None), (None, (4, 64))])
@pytest.mark.parametrize("G", [1, 2, 3, 5, 8, 9])
def test_groups_and_formats(k_quant, v_quant, G):
    lens = [1, 17, 300]
    check(*make_case(lens, 2 * G, 2, 64, 16, seed=G, k_quant=k_quant, v_quant=v_quant), lens)


@pytest.mark.parametrize("D,group", [(128, 32), (128, 64), (128, 128), (64, 32)])
@pytest.mark.parametrize("bits", [4, 8])
def test_head_dims_and_groups(D, group, bits):
    lens = [40, 129]
    check(*make_case(lens, 6, 2, D, 16, seed=D + group, k_quant=(bits, group),
                     v_quant=(bits, group)), lens)


@pytest.mark.parametrize("bs", [4, 8, 24, 32, 48])
def test_block_sizes(bs):
    lens = [3, 50, 131]
    check(*make_case(lens, 9, 3, 64, bs, seed=bs, k_quant=(8, 64), v_quant=(4, 64)), lens)


@pytest.mark.parametrize("window,sinks", [(1, False), (7, True), (40, False), (100, True)])
@pytest.mark.parametrize("bs", [16, 32])
def test_windows_starting_inside_a_block(window, sinks, bs):
    lens = [37, 5, 210]
    q, k, v, tables = make_case(lens, 6, 2, 64, bs, seed=window, k_quant=(8, 64),
                                v_quant=(4, 32))
    check(q, k, v, tables, lens, spec_of(q, window, sinks))


def test_long_context_split_over_threads():
    lens = [5000]
    check(*make_case(lens, 9, 3, 64, 16, seed=5, k_quant=(4, 64), v_quant=(4, 64)), lens)


def dequantized_f32(pool: QuantizedBlocks) -> mx.array:
    """The pool's rows dequantized in float32 (the reference rounds them to float16)."""
    q = pool.quant
    return mx.dequantize(pool.data, pool.scales.astype(mx.float32),
                         pool.biases.astype(mx.float32), group_size=q.group_size, bits=q.bits)


def float32_error(q, k, v, tables, lens) -> float:
    """Max |kernel - attention over the float32-dequantized pools|."""
    spec = AttentionSpec(q.shape[-1] ** -0.5, None, None)
    out = cpu.paged_decode(q, k, v, tables, lens, spec)
    ref = paged_attention_ref(q, dequantized_f32(k), dequantized_f32(v), tables, lens, spec)
    return mx.abs(out - ref).max().item()


@pytest.mark.parametrize("bits", [8, 4])
def test_keys_far_from_zero_and_a_zero_query(bits):
    # an offset on every key (the bias term carries it) and an all-zero query head (its
    # int16 step is 0)
    lens = [70, 300]
    q, k, v, tables = make_case(lens, 6, 2, 64, 16, seed=1)
    q = mx.concatenate([mx.zeros_like(q[:, :1]), q[:, 1:]], axis=1)
    k, v = quantize_pool(k + 40.0, bits, 64), quantize_pool(v, bits, 64)
    assert float32_error(q, k, v, tables, lens) < 1e-4


@pytest.mark.parametrize("kv", [(8, 8), (8, 4), (4, 4)])
def test_error_is_float_rounding(kv):
    # against the float32-dequantized pools: the float path (9 heads per KV head: the
    # general task, which dequantizes rows) errs ~3e-7, the integer one (3 heads) ~2e-5,
    # the int16 queries' rounding; 8-bit keys themselves move the output by ~1e-2
    lens = [900]
    errs = []
    for G in (3, 9):
        q, k, v, tables = make_case(lens, 3 * G, 3, 64, 16, seed=2, k_quant=(kv[0], 64),
                                    v_quant=(kv[1], 64))
        errs.append(float32_error(q, k, v, tables, lens))
    assert errs[0] < 1e-4 and errs[1] < 2e-6, errs


@pytest.mark.parametrize("q_dtype", [mx.float32, mx.float16])
@pytest.mark.parametrize("rotated", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("L", [1, 5])
def test_rotation_inside_the_op_is_the_rotation_around_it(rotated, L, q_dtype):
    # the op's own rotation of queries and outputs gives, bit for bit, what the two
    # `rotation` ops around it give (decode and prefill)
    from engine.kvcache import rotation

    lens = [40, 77]
    q, k, v, tables = make_case(lens, 6, 2, 64, 16, seed=L, k_quant=(8, 64), v_quant=(4, 64))
    q = mx.random.normal((2, 6, L, 64), key=mx.random.key(L)).astype(q_dtype)
    op = cpu.paged_decode if L == 1 else cpu.paged_prefill
    inside = op(q, k, v, tables, lens, 0.125, rotated=rotated)
    around = op(rotation.rotate(q) if rotated[0] else q, k, v, tables, lens, 0.125)
    around = rotation.unrotate(around) if rotated[1] else around
    assert inside.dtype == q_dtype
    assert mx.array_equal(inside, around)


def test_rotated_pools_through_the_dispatcher_match_the_reference():
    # `paged_attention` on a rotated pool: the CPU op rotating inside, the reference with
    # the rotation ops around it
    from engine.kvcache import rotation
    from engine.kvcache.quant import QuantSpec
    from engine.model.attention import paged_attention

    lens = [33, 260]
    q, k, v, tables = make_case(lens, 9, 3, 64, 16, seed=4)
    H, nb, bs, D = k.shape

    def rotated_pool(pool, bits):
        rows = rotation.rotate(pool.reshape(-1, D))
        data, s, b = mx.quantize(rows, group_size=64, bits=bits)
        return QuantizedBlocks(data.reshape(H, nb, bs, -1), s.astype(mx.float16).reshape(
            H, nb, bs, -1), b.astype(mx.float16).reshape(H, nb, bs, -1),
            QuantSpec(bits, 64, 1), D)

    kr, vr = rotated_pool(k, 8), rotated_pool(v, 8)
    out = paged_attention(q, kr, vr, tables, lens, 0.125)
    ref = rotation.unrotate(paged_attention_ref(rotation.rotate(q), kr, vr, tables, lens,
                                                AttentionSpec(0.125, None, None)))
    assert mx.abs(out - ref).max().item() < 2e-3
    plain = paged_attention_ref(q, k, v, tables, lens, AttentionSpec(0.125, None, None))
    assert mx.abs(out - plain).max().item() < 0.05  # what 8-bit K/V cost, rotated back
