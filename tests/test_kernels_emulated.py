"""The Metal (and CUDA) decode kernel, run on the CPU from MLX's generated source.

Each case traces the exact MSL that `mx.fast.metal_kernel` would compile,
builds it as C++ with tests/kernel_harness/msl_shim.h, runs it with one thread
per lane and compares with `paged_attention_ref`. Bounds (max abs error vs the
reference): fp16 2e-3, fp32 1e-5, bf16 1.6e-2 (the fp16 bound scaled by bf16's
8x larger epsilon: the reference itself rounds to bf16 inside SDPA). Every
case must also be within half an ulp (+1e-5) of an fp32 oracle on the same
values, i.e. the kernel accumulates in fp32 and rounds once.

Sanitizer builds (ASan, TSan, UBSan) of small cases must run clean; every
emulated run also goes through the shim's checked threadgroup arrays, which
fail a read not ordered after its write by a mem_threadgroup barrier.

Quantized pools (QUANT_* cases) keep the same bounds, unloosened: the kernel
dequantizes in registers to exactly the float16 values mx.dequantize gives
the reference, so only the accumulation differs, as for a float16 pool.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from kernel_harness import emulator, paged
from kernel_harness.cases import (
    CUDA_CASES,
    EMULATED_CASES,
    QUANT_CASES,
    QUANT_CUDA_CASES,
    QUANT_SANITIZER_CASES,
    SANITIZER_CASES,
    Case,
    make_inputs,
)

TOLERANCE = {"float16": 2e-3, "bfloat16": 1.6e-2, "float32": 1e-5}
METAL_CASES = EMULATED_CASES + QUANT_CASES
METAL_SANITIZER_CASES = SANITIZER_CASES + QUANT_SANITIZER_CASES
ALL_CUDA_CASES = CUDA_CASES + QUANT_CUDA_CASES
CUDA_SANITIZER_CASES = CUDA_CASES[:1] + QUANT_CUDA_CASES[:1]


@pytest.fixture(scope="module")
def work_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("kernel_emulation")


@pytest.fixture(scope="module")
def binaries(work_dir):
    """All emulator builds for this module, compiled concurrently."""
    metal = {c: paged.metal_source(c, make_inputs(c)) for c in METAL_CASES + METAL_SANITIZER_CASES}
    cuda = {c: paged.cuda_source(c, make_inputs(c)) for c in ALL_CUDA_CASES}
    jobs = {
        "metal": ([metal[c] for c in METAL_CASES], None),
        "metal-address": ([metal[c] for c in METAL_SANITIZER_CASES], "address"),
        "metal-thread": ([metal[c] for c in METAL_SANITIZER_CASES], "thread"),
        "cuda": (list(cuda.values()), None),
        "cuda-address": ([cuda[c] for c in CUDA_SANITIZER_CASES], "address"),
        "cuda-thread": ([cuda[c] for c in CUDA_SANITIZER_CASES], "thread"),
        "metal-undefined": ([metal[c] for c in METAL_SANITIZER_CASES], "undefined"),
        "cuda-undefined": ([cuda[c] for c in CUDA_SANITIZER_CASES], "undefined"),
    }
    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = {
            key: pool.submit(emulator.build, srcs, work_dir, sanitizer=san)
            for key, (srcs, san) in jobs.items()
        }
        built = {key: f.result() for key, f in futures.items()}
    return built, metal, cuda


def check_case(case: Case, out, result: emulator.RunResult, inputs: dict) -> None:
    assert result.ok, f"emulator failed (rc={result.returncode}):\n{result.stderr[-4000:]}"
    assert out is not None
    err = paged.max_abs_error(out, paged.reference(inputs))
    assert err <= TOLERANCE[case.dtype], f"{case.id}: max abs error {err:.3g} vs reference"
    excess = paged.ulp_excess(out, paged.reference(inputs, fp32=True))
    assert excess <= 0.0, f"{case.id}: {excess:.3g} ulp beyond half an ulp of the fp32 oracle"


@pytest.mark.parametrize("case", METAL_CASES, ids=lambda c: c.id)
def test_metal_kernel_matches_reference(case, binaries, work_dir):
    built, metal, _ = binaries
    inputs = make_inputs(case)
    out, result = paged.emulate(built["metal"], metal[case], case, inputs, work_dir)
    check_case(case, out, result, inputs)


@pytest.mark.parametrize("case", ALL_CUDA_CASES, ids=lambda c: c.id)
def test_cuda_kernel_matches_reference(case, binaries, work_dir):
    built, _, cuda = binaries
    inputs = make_inputs(case)
    out, result = paged.emulate(built["cuda"], cuda[case], case, inputs, work_dir)
    check_case(case, out, result, inputs)


def test_emulated_cases_cover_the_matrix():
    cases = EMULATED_CASES
    assert len(cases) >= 20
    assert {c.dtype for c in cases} == {"float16", "bfloat16", "float32"}
    assert {c.head_dim for c in cases} >= {64, 128}
    assert {c.block_size for c in cases} >= {8, 16, 32}
    assert {c.num_q_heads // c.num_kv_heads for c in cases} >= {1, 3, 8}
    lens = [n for c in cases for n in c.context_lens]
    assert any(n % c.block_size for c in cases for n in c.context_lens)  # partial last block
    assert any(n % c.block_size == 0 for c in cases for n in c.context_lens)
    assert 1 in lens and any(len(set(c.context_lens)) > 1 for c in cases)


def test_quantized_cases_cover_the_matrix():
    cases = QUANT_CASES
    sides = [q for c in cases for q in (c.k_quant, c.v_quant) if q]
    assert {bits for bits, _ in sides} == {4, 8}
    assert {group for _, group in sides} >= {32, 64, 128}
    assert any(c.k_quant and c.v_quant and c.k_quant != c.v_quant for c in cases)  # k8/v4
    assert any(c.k_quant and not c.v_quant for c in cases)  # V plain
    assert any(c.v_quant and not c.k_quant for c in cases)  # K plain
    assert {c.dtype for c in cases} == {"float16", "bfloat16", "float32"}
    assert any(c.num_q_heads > c.num_kv_heads for c in cases)  # GQA
    assert any(len(set(c.context_lens)) > 1 for c in cases)  # ragged
    assert any(n > 2 * c.block_size for c in cases for n in c.context_lens)  # several blocks
    # D = 96: EPL = 3 dims per lane, straddling packed words and groups.
    assert any(c.head_dim // 32 % 2 for c in cases)


def _sanitizer_params():
    for san in ("address", "thread", "undefined"):
        for case in METAL_SANITIZER_CASES:
            yield pytest.param("metal", san, case, id=f"metal-{san}-{case.id}")
        for case in CUDA_SANITIZER_CASES:
            yield pytest.param("cuda", san, case, id=f"cuda-{san}-{case.id}")


@pytest.mark.parametrize(("backend", "sanitizer", "case"), list(_sanitizer_params()))
def test_sanitizer_build_is_clean(backend, sanitizer, case, binaries, work_dir):
    built, metal, cuda = binaries
    src = (metal if backend == "metal" else cuda)[case]
    inputs = make_inputs(case)
    out, result = paged.emulate(
        built[f"{backend}-{sanitizer}"], src, case, inputs, work_dir, timeout_s=300
    )
    assert "Sanitizer" not in result.stderr, result.stderr[-6000:]
    assert "runtime error" not in result.stderr, result.stderr[-6000:]  # UBSan
    check_case(case, out, result, inputs)


def test_threadgroup_memory_matches_static_count(binaries, work_dir):
    """The emulator's registered threadgroup bytes equal the lint's count."""
    from kernel_harness import msl_lint

    from metal_kernels import kernel_header, read_source

    built, metal, _ = binaries
    case = EMULATED_CASES[0]
    _, result = paged.emulate(built["metal"], metal[case], case, make_inputs(case), work_dir)
    text = kernel_header("metal") + read_source("paged_attention.metal")
    expected = msl_lint.threadgroup_bytes(text, {"NSG": case.num_simdgroups, "D": case.head_dim})
    assert result.tg_bytes == expected
