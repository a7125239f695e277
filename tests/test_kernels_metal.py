"""The real Metal kernel against the reference (Apple GPU only)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from kernel_harness import paged
from kernel_harness.cases import EMULATED_CASES, QUANT_CASES, Case, make_inputs

from engine.model.attention.gpu import abi, one_pass, two_pass

pytestmark = [
    pytest.mark.metal,
    pytest.mark.skipif(not mx.metal.is_available(), reason="needs Metal (Apple GPU)"),
]
TOLERANCE = {"float16": 2e-3, "bfloat16": 1.6e-2, "float32": 1e-5}
# Engine-default tiling (8 simdgroups) on the emulated shapes plus longer contexts.
CASES = [
    Case(
        c.dtype,
        c.head_dim,
        c.block_size,
        c.num_q_heads,
        c.num_kv_heads,
        c.context_lens,
        num_simdgroups=abi.NUM_SIMDGROUPS,
        kv_dtype=c.kv_dtype,
    )
    for c in EMULATED_CASES
] + [
    Case("float16", 128, 16, 32, 8, (1, 700, 2049, 4096)),
    Case("bfloat16", 64, 32, 24, 8, (3000, 15)),
]


QUANT = [
    Case(
        c.dtype,
        c.head_dim,
        c.block_size,
        c.num_q_heads,
        c.num_kv_heads,
        c.context_lens,
        num_simdgroups=abi.NUM_SIMDGROUPS,
        kv_dtype=c.kv_dtype,
        k_quant=c.k_quant,
        v_quant=c.v_quant,
    )
    for c in QUANT_CASES
] + [Case("float16", 128, 16, 32, 8, (1, 700, 2049), k_quant=(8, 64), v_quant=(4, 64))]
# MLX's Metal dequantize computes scale * q + bias in half, which the compiler
# may fuse into one rounding; the kernel (and the CPU) round twice. Against the
# GPU reference, fp32 queries therefore get the fp16 bound; the strict check
# is the half-ulp one against the CPU-dequantized fp32 oracle.
QUANT_TOLERANCE = dict(TOLERANCE, float32=TOLERANCE["float16"])


@pytest.mark.parametrize("case", QUANT, ids=lambda c: c.id)
def test_quantized_metal_kernel_matches_reference(case):
    inputs = make_inputs(case)
    out = one_pass.paged_decode_attention(**inputs)
    err = paged.max_abs_error(out, paged.reference(inputs))
    assert err <= QUANT_TOLERANCE[case.dtype], f"{case.id}: {err:.3g}"
    assert paged.ulp_excess(out, paged.reference(inputs, fp32=True)) <= 0.0


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_metal_kernel_matches_reference(case):
    inputs = make_inputs(case)
    out = one_pass.paged_decode_attention(**inputs)
    assert out.shape == inputs["queries"].shape and out.dtype == inputs["queries"].dtype
    err = paged.max_abs_error(out, paged.reference(inputs))
    assert err <= TOLERANCE[case.dtype], f"{case.id}: {err:.3g}"
    assert paged.ulp_excess(out, paged.reference(inputs, fp32=True)) <= 0.0


def test_kernel_is_built_once():
    case = Case("float16", 64, 16, 4, 2, (9, 17))
    one_pass.paged_decode_attention(**make_inputs(case))
    one_pass.paged_decode_attention(**make_inputs(case))
    assert one_pass._paged_decode_kernel.cache_info().misses == 1


TWO_PASS = [
    (Case("float16", 128, 16, 32, 8, (1, 700, 2049, 4096)), 512),
    (Case("bfloat16", 64, 32, 24, 8, (3000, 15)), 256),
    (Case("float16", 128, 16, 32, 8, (32768,)), 512),
    (Case("float32", 64, 16, 8, 1, (37, 5, 16)), 16),
    (Case("float16", 128, 16, 32, 8, (1, 700, 2049), k_quant=(8, 64), v_quant=(4, 64)), 512),
]


@pytest.mark.parametrize(("case", "ps"), TWO_PASS, ids=lambda x: getattr(x, "id", str(x)))
def test_two_pass_metal_kernel_matches_reference(case, ps):
    inputs = make_inputs(case)
    out = two_pass.paged_decode_two_pass(**inputs, partition_tokens=ps)
    tol = (QUANT_TOLERANCE if case.k_quant else TOLERANCE)[case.dtype]
    err = paged.max_abs_error(out, paged.reference(inputs))
    assert err <= tol, f"{case.id}: {err:.3g}"
    assert paged.ulp_excess(out, paged.reference(inputs, fp32=True)) <= 0.0
