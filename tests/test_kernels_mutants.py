"""Deliberately broken kernels: the emulator harness must catch each one.

- off-by-one block index: wrong numbers, and an AddressSanitizer overflow on
  the block table when the table has no padding column;
- missing threadgroup_barrier before the merge: ThreadSanitizer data race (in
  the real TG_ARRAY mode, unchecked arrays; the checked mode's verdict is in
  test_kernels_harness.py);
- simd_sum in lane-dependent control flow: the shim's barrier call-site check
  (different call sites) or its barrier timeout (lanes that skip it).

Quantized variant (mutations of the dequantizing row reader in common.h):
- every dim takes the group of dim 0: wrong numbers (Metal and CUDA);
- group index off by one: wrong numbers, and an AddressSanitizer overflow on
  the scales when the pool's last row is read;
- dequantize in fp32 without mx.dequantize's float16 roundings: the fp32
  bound (1e-5) catches the drift from the reference.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from kernel_harness import emulator, msl_lint, paged
from kernel_harness.cases import Case, make_inputs

from metal_kernels import kernel_header

CASE = Case("float16", 64, 8, 4, 2, (21, 9))
TSAN_CASE = Case("float32", 64, 8, 2, 1, (12,))
# The last sequence is the longest, so index t / BS + 1 runs past the table.
ASAN_CASE = Case("float16", 64, 8, 4, 2, (9, 21))
BARRIER_TIMEOUT_MS = 1500

OFF_BY_ONE = paged.mutate("t / BS]", "t / BS + 1]")
NO_BARRIER = paged.mutate("  threadgroup_barrier(mem_flags::mem_threadgroup);\n", "")
SIMD_TWO_SITES = paged.mutate(
    "    s = simd_sum(s);\n",
    "    if (lane % 2 == 0) {\n      s = simd_sum(s);\n    } else {\n"
    "      s = simd_sum(s * 1.0f);\n    }\n",
)
SIMD_SKIPPED = paged.mutate(
    "    s = simd_sum(s);\n", "    if (t + lane < num_tokens) {\n      s = simd_sum(s);\n    }\n"
)

# D = 64 with group 32: lanes 16-31 own dims of the second group.
QCASE = Case("float16", 64, 8, 4, 2, (21, 9), k_quant=(8, 32), v_quant=(4, 32))
QCASE_FP32 = Case("float32", 64, 8, 4, 2, (21, 9), k_quant=(8, 32), v_quant=(4, 32))
# No spare blocks and whole blocks only: the pool's last row is read, so the
# group past it lies past the end of the scales.
QASAN_CASE = Case("float16", 64, 8, 2, 1, (16, 8), k_quant=(8, 32), v_quant=(8, 32))
GROUP_LINE = "      const int group = dim / GROUP;\n"
GROUP_OF_DIM0 = "      const int group = 0;\n"
GROUP_PLUS_ONE = "      const int group = dim / GROUP + 1;\n"
DEQUANT_ROUNDED = (
    "  const float scaled = pa_to_float(pa_from_float<S>(pa_to_float(scale) * float(q)));\n"
    "  return pa_to_float(pa_from_float<S>(scaled + pa_to_float(bias)));\n"
)
DEQUANT_FP32 = "  return pa_to_float(scale) * float(q) + pa_to_float(bias);\n"


def _quant_mutants() -> dict[str, emulator.KernelSource]:
    """name -> source of the quantized-variant mutants (common.h edited)."""
    inputs, fp32 = make_inputs(QCASE), make_inputs(QCASE_FP32)
    tight = make_inputs(QASAN_CASE, spare_blocks=0)

    def metal(case, case_inputs, old, new, name):
        header = paged.mutate_header(old, new)
        return paged.metal_source(case, case_inputs, header=header, name=name)

    cuda_header = paged.mutate_header(GROUP_LINE, GROUP_OF_DIM0, backend="cuda")
    return {
        "group_dim0": metal(QCASE, inputs, GROUP_LINE, GROUP_OF_DIM0, "mut_gdim0"),
        "group_plus_one": metal(QCASE, inputs, GROUP_LINE, GROUP_PLUS_ONE, "mut_gp1"),
        "dequant_fp32": metal(QCASE_FP32, fp32, DEQUANT_ROUNDED, DEQUANT_FP32, "mut_deq32"),
        "group_plus_one_tight": metal(QASAN_CASE, tight, GROUP_LINE, GROUP_PLUS_ONE, "mut_gp1"),
        "cuda_group_dim0": paged.cuda_source(QCASE, inputs, header=cuda_header, name="mut_gdim0"),
    }


@pytest.fixture(scope="module")
def work_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("kernel_mutants")


@pytest.fixture(scope="module")
def mutants(work_dir):
    """name -> (binary, source); plain mutants share one binary, sanitizers get their own."""
    inputs = make_inputs(CASE)
    tight = make_inputs(ASAN_CASE, spare_columns=0)
    srcs = {
        "off_by_one": paged.metal_source(CASE, inputs, body=OFF_BY_ONE, name="mut_obo"),
        "off_by_one_tight": paged.metal_source(ASAN_CASE, tight, body=OFF_BY_ONE, name="mut_obo"),
        "simd_two_sites": paged.metal_source(CASE, inputs, body=SIMD_TWO_SITES, name="mut_div"),
        "simd_skipped": paged.metal_source(CASE, inputs, body=SIMD_SKIPPED, name="mut_skip"),
        "no_barrier": paged.metal_source(
            TSAN_CASE, make_inputs(TSAN_CASE), body=NO_BARRIER, name="mut_nobar"
        ),
    }
    srcs.update(_quant_mutants())
    # Kernels in one binary share the include-guarded header text of the first,
    # so each header mutant gets a binary of its own.
    jobs = {
        "plain": (["off_by_one", "simd_two_sites", "simd_skipped"], None),
        "off_by_one_tight": (["off_by_one_tight"], "address"),
        "no_barrier": (["no_barrier"], "thread", "real"),
        "group_dim0": (["group_dim0"], None),
        "group_plus_one": (["group_plus_one"], None),
        "group_plus_one_tight": (["group_plus_one_tight"], "address"),
        "dequant_fp32": (["dequant_fp32"], None),
        "cuda_group_dim0": (["cuda_group_dim0"], None),
    }
    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = {
            job: pool.submit(
                emulator.build, [srcs[n] for n in spec[0]], work_dir, sanitizer=spec[1],
                tg_mode=spec[2] if len(spec) > 2 else "checked",
            )
            for job, spec in jobs.items()
        }
        bins = {name: futures[job].result() for job, spec in jobs.items() for name in spec[0]}
    return {name: (bins[name], src) for name, src in srcs.items()}


def test_off_by_one_block_index_gives_wrong_numbers(mutants, work_dir):
    binary, src = mutants["off_by_one"]
    inputs = make_inputs(CASE)
    out, result = paged.emulate(binary, src, CASE, inputs, work_dir)
    assert result.ok  # reads a valid (padding) block: only the numbers show it
    assert paged.max_abs_error(out, paged.reference(inputs)) > 0.05


def test_off_by_one_block_index_overflows_table_under_asan(mutants, work_dir):
    binary, src = mutants["off_by_one_tight"]
    _, result = paged.emulate(
        binary, src, ASAN_CASE, make_inputs(ASAN_CASE, spare_columns=0), work_dir, timeout_s=300
    )
    assert not result.ok
    assert "AddressSanitizer: heap-buffer-overflow" in result.stderr, result.stderr[-3000:]


def test_missing_barrier_is_a_tsan_data_race(mutants, work_dir):
    binary, src = mutants["no_barrier"]
    _, result = paged.emulate(
        binary, src, TSAN_CASE, make_inputs(TSAN_CASE), work_dir, timeout_s=300
    )
    assert "ThreadSanitizer: data race" in result.stderr, result.stderr[-3000:]
    assert "tg_" in result.stderr  # the race is on a threadgroup array


def test_divergent_simd_sum_call_sites_fail_fast(mutants, work_dir):
    binary, src = mutants["simd_two_sites"]
    _, result = paged.emulate(
        binary, src, CASE, make_inputs(CASE), work_dir, barrier_timeout_ms=BARRIER_TIMEOUT_MS
    )
    assert result.returncode == 86, result.stderr[-2000:]
    assert "divergence at simdgroup barrier" in result.stderr


def test_simd_sum_skipped_by_some_lanes_times_out(mutants, work_dir):
    binary, src = mutants["simd_skipped"]
    _, result = paged.emulate(
        binary, src, CASE, make_inputs(CASE), work_dir, barrier_timeout_ms=BARRIER_TIMEOUT_MS
    )
    assert result.returncode in (86, 87), result.stderr[-2000:]
    assert "timeout" in result.stderr or "divergence" in result.stderr


@pytest.mark.parametrize("body", [SIMD_TWO_SITES, SIMD_SKIPPED], ids=["two_sites", "skipped"])
def test_lint_flags_lane_dependent_simd(body):
    problems = msl_lint.lint_msl(kernel_header("metal") + body)
    assert any("lane-dependent" in p for p in problems), problems


@pytest.mark.parametrize("name", ["group_dim0", "group_plus_one", "cuda_group_dim0"])
def test_wrong_group_index_gives_wrong_numbers(name, mutants, work_dir):
    binary, src = mutants[name]
    inputs = make_inputs(QCASE)
    out, result = paged.emulate(binary, src, QCASE, inputs, work_dir)
    assert result.ok, result.stderr[-2000:]  # in-bounds scales: only the numbers show it
    assert paged.max_abs_error(out, paged.reference(inputs)) > 0.05


def test_group_index_past_the_row_overflows_scales_under_asan(mutants, work_dir):
    binary, src = mutants["group_plus_one_tight"]
    inputs = make_inputs(QASAN_CASE, spare_blocks=0)
    _, result = paged.emulate(binary, src, QASAN_CASE, inputs, work_dir, timeout_s=300)
    assert not result.ok
    assert "AddressSanitizer: heap-buffer-overflow" in result.stderr, result.stderr[-3000:]


def test_dequantizing_without_float16_rounding_drifts_from_reference(mutants, work_dir):
    binary, src = mutants["dequant_fp32"]
    inputs = make_inputs(QCASE_FP32)
    out, result = paged.emulate(binary, src, QCASE_FP32, inputs, work_dir)
    assert result.ok, result.stderr[-2000:]
    assert paged.max_abs_error(out, paged.reference(inputs)) > 1e-5  # the fp32 bound
