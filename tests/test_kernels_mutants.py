"""Deliberately broken kernels: the emulator harness must catch each one.

- off-by-one block index: wrong numbers, and an AddressSanitizer overflow on
  the block table when the table has no padding column;
- missing threadgroup_barrier before the merge: ThreadSanitizer data race;
- simd_sum in lane-dependent control flow: the shim's barrier call-site check
  (different call sites) or its barrier timeout (lanes that skip it).
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
    plain = [srcs["off_by_one"], srcs["simd_two_sites"], srcs["simd_skipped"]]
    with ThreadPoolExecutor(max_workers=3) as pool:
        plain_bin = pool.submit(emulator.build, plain, work_dir)
        asan_bin = pool.submit(
            emulator.build, [srcs["off_by_one_tight"]], work_dir, sanitizer="address"
        )
        tsan_bin = pool.submit(emulator.build, [srcs["no_barrier"]], work_dir, sanitizer="thread")
        bins = {
            "off_by_one": plain_bin.result(),
            "simd_two_sites": plain_bin.result(),
            "simd_skipped": plain_bin.result(),
            "off_by_one_tight": asan_bin.result(),
            "no_barrier": tsan_bin.result(),
        }
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
