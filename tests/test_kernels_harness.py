"""The harness's own gaps, closed: each check is shown to catch a broken kernel.

- memory flags: a threadgroup_barrier(mem_flags::mem_none) before the merge
  still synchronises execution, so the numbers come out right; the shim's
  checked threadgroup arrays fail it (no barrier with mem_threadgroup orders
  the write before the read), as they fail a missing barrier without TSan;
- lint: a lane-dependent loop bound, simd_sum under a flag derived from the
  lane, and a lane-dependent early return (the emulator catches the first by
  its barrier timeout too);
- UBSan: clean on the real kernels; a packed-word shift past 32 bits (a
  quantized reader bug that x86 hides by masking the count) fails;
- CUDA mutants: block index off by one (ASan overflow on the table), a warp
  butterfly missing a level (wrong numbers), __syncthreads dropped (checked
  arrays);
- the real TG_ARRAY expansions (`threadgroup T x[N]`, `__shared__ T x[N]`)
  compiled and run instead of the shim's.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from kernel_harness import emulator, msl_lint, paged
from kernel_harness.cases import Case, make_inputs

from metal_kernels import kernel_header

CASE = Case("float16", 64, 8, 4, 2, (21, 9))
QCASE = Case("float16", 64, 8, 4, 2, (21, 9), k_quant=(8, 32), v_quant=(4, 32))
ASAN_CASE = Case("float16", 64, 8, 4, 2, (9, 21))  # longest last: t / BS + 1 runs off
REAL_CASES = [
    Case("float16", 64, 16, 6, 2, (37, 5)),
    Case("float32", 96, 8, 4, 1, (20, 3), k_quant=(4, 32), v_quant=(8, 32), num_simdgroups=4),
]
TOLERANCE = {"float16": 2e-3, "bfloat16": 1.6e-2, "float32": 1e-5}
EXIT_MEM_ORDER = 89

BARRIER = "  threadgroup_barrier(mem_flags::mem_threadgroup);\n"
MEM_NONE = paged.mutate(BARRIER, "  threadgroup_barrier(mem_flags::mem_none);\n")
NO_BARRIER = paged.mutate(BARRIER, "")
LOOP = "  for (int t = t_first + sg; t < num_tokens; t += NSG) {\n"
LANE_BOUND = paged.mutate(
    LOOP, "  for (int t = t_first + sg; t < num_tokens - (lane & 1); t += NSG) {\n")
SIMD = "    s = simd_sum(s);\n"
DERIVED_FLAG = paged.mutate(
    SIMD, "    const bool upper = lane >= 16;\n    if (!upper) {\n      s = simd_sum(s);\n    }\n"
)
EARLY_RETURN = paged.mutate(BARRIER, "  if (lane >= 30) {\n    return;\n  }\n" + BARRIER)
SHIFT = "(word >> ((dim % PER_WORD) * BITS))"
SHIFT_PAST_WORD = "(word >> (dim * BITS))"
OBO = paged.mutate("t / BS]", "t / BS + 1]")
BUTTERFLY = "  for (int offset = 16; offset > 0; offset /= 2) {\n    x += __shfl_xor_sync"
BUTTERFLY_SHORT = "  for (int offset = 8; offset > 0; offset /= 2) {\n    x += __shfl_xor_sync"
SYNCTHREADS = "PA_FN void threadgroup_barrier(int) {\n  __syncthreads();\n}"
NO_SYNCTHREADS = "PA_FN void threadgroup_barrier(int) {\n}"


@pytest.fixture(scope="module")
def work_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("kernel_harness")


def _jobs():
    """job -> (case, sources, sanitizer, TG mode, spare table columns)."""
    inputs, qinputs = make_inputs(CASE), make_inputs(QCASE)
    tight = make_inputs(ASAN_CASE, spare_columns=0)

    def metal(body=None, header=None, name="mut", case=CASE, case_inputs=inputs):
        return paged.metal_source(case, case_inputs, body=body, header=header, name=name)

    def cuda(body=None, header=None, name="mut", case=CASE, case_inputs=inputs):
        return paged.cuda_source(case, case_inputs, body=body, header=header, name=name)

    return {
        "mem_none": (CASE, metal(MEM_NONE, name="mut_memnone"), None, "checked", 1),
        "no_barrier": (CASE, metal(NO_BARRIER, name="mut_nobar"), None, "checked", 1),
        "lane_bound": (CASE, metal(LANE_BOUND, name="mut_bound"), None, "checked", 1),
        "ubsan_shift": (
            QCASE,
            metal(header=paged.mutate_header(SHIFT, SHIFT_PAST_WORD), case=QCASE,
                  case_inputs=qinputs),
            "undefined", "checked", 1,
        ),
        "cuda_obo_tight": (
            ASAN_CASE, cuda(OBO, case=ASAN_CASE, case_inputs=tight), "address", "checked", 0,
        ),
        "cuda_butterfly": (
            CASE, cuda(header=paged.mutate_header(BUTTERFLY, BUTTERFLY_SHORT, "cuda")), None,
            "checked", 1,
        ),
        "cuda_no_syncthreads": (
            CASE, cuda(header=paged.mutate_header(SYNCTHREADS, NO_SYNCTHREADS, "cuda")), None,
            "checked", 1,
        ),
    }


@pytest.fixture(scope="module")
def built(work_dir):
    """job -> (binary, source, case, spare columns); the first three mutants share a binary."""
    jobs = _jobs()
    shared = ["mem_none", "no_barrier", "lane_bound"]
    with ThreadPoolExecutor(max_workers=2) as pool:
        shared_bin = pool.submit(emulator.build, [jobs[j][1] for j in shared], work_dir)
        own = {
            j: pool.submit(emulator.build, [src], work_dir, sanitizer=san, tg_mode=mode)
            for j, (_, src, san, mode, _) in jobs.items()
            if j not in shared
        }
        bins = {j: shared_bin.result() for j in shared} | {j: f.result() for j, f in own.items()}
    return {j: (bins[j], src, case, spare) for j, (case, src, _, _, spare) in jobs.items()}


def _run(built, work_dir, job, **options):
    binary, src, case, spare = built[job]
    inputs = make_inputs(case, spare_columns=spare)
    out, result = paged.emulate(binary, src, case, inputs, work_dir, **options)
    return out, result, inputs


@pytest.mark.parametrize(
    ("job", "expected"),
    [
        # Execution is synchronised, so every write happened: only the flags are wrong.
        ("mem_none", "no barrier with mem_flags::mem_threadgroup between them"),
        # No barrier: a read either races a write or comes before any.
        ("no_barrier", " tg_"),
        ("cuda_no_syncthreads", " tg_"),
    ],
)
def test_unordered_threadgroup_memory_fails_in_checked_mode(job, expected, built, work_dir):
    _, result, _ = _run(built, work_dir, job)
    assert result.returncode == EXIT_MEM_ORDER, result.stderr[-2000:]
    assert expected in result.stderr, result.stderr[-2000:]


def test_lane_dependent_loop_bound_times_out(built, work_dir):
    _, result, _ = _run(built, work_dir, "lane_bound", barrier_timeout_ms=1500)
    assert result.returncode in (86, 87), result.stderr[-2000:]


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (LANE_BOUND, "lane-dependent loop bound"),
        (DERIVED_FLAG, "lane-dependent branch: '!upper'"),
        (EARLY_RETURN, "lane-dependent return"),
    ],
    ids=["loop_bound", "derived_flag", "early_return"],
)
def test_lint_flags_lane_divergence(body, expected):
    problems = msl_lint.lint_msl(kernel_header("metal") + body)
    assert any(expected in p for p in problems), problems


def test_lint_taint_stays_off_uniform_values():
    code = msl_lint.strip_comments(kernel_header("metal") + paged.BODY)
    varying = msl_lint.lane_varying_names(code)
    assert {"dim", "q_offset", "d"} <= varying
    assert not {"t", "sg", "num_tokens", "head", "seq", "kv_head"} & varying


def test_ubsan_catches_a_shift_past_the_word(built, work_dir):
    _, result, _ = _run(built, work_dir, "ubsan_shift", timeout_s=300)
    assert not result.ok
    assert "runtime error: shift exponent" in result.stderr, result.stderr[-3000:]


def test_cuda_block_index_off_by_one_overflows_the_table(built, work_dir):
    _, result, _ = _run(built, work_dir, "cuda_obo_tight", timeout_s=300)
    assert not result.ok
    assert "AddressSanitizer: heap-buffer-overflow" in result.stderr, result.stderr[-3000:]


def test_cuda_short_butterfly_gives_wrong_numbers(built, work_dir):
    out, result, inputs = _run(built, work_dir, "cuda_butterfly")
    assert result.ok, result.stderr[-2000:]
    assert paged.max_abs_error(out, paged.reference(inputs)) > 0.05


@pytest.fixture(scope="module")
def real_mode(work_dir):
    """The real kernels built with the backends' own TG_ARRAY (plain and under TSan)."""
    metal = {c: paged.metal_source(c, make_inputs(c)) for c in REAL_CASES}
    cuda = {c: paged.cuda_source(c, make_inputs(c)) for c in REAL_CASES}
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {
            (backend, san): pool.submit(emulator.build, list(srcs.values()), work_dir,
                                        sanitizer=san, tg_mode="real")
            for backend, srcs in (("metal", metal), ("cuda", cuda))
            for san in (None, "thread")
        }
        bins = {key: f.result() for key, f in futures.items()}
    return bins, {"metal": metal, "cuda": cuda}


@pytest.mark.parametrize("sanitizer", [None, "thread"], ids=["plain", "tsan"])
@pytest.mark.parametrize("backend", ["metal", "cuda"])
@pytest.mark.parametrize("case", REAL_CASES, ids=lambda c: c.id)
def test_real_tg_array_expansion_matches_reference(case, backend, sanitizer, real_mode,
                                                   work_dir):
    bins, srcs = real_mode
    inputs = make_inputs(case)
    out, result = paged.emulate(bins[backend, sanitizer], srcs[backend][case], case, inputs,
                                work_dir, timeout_s=300)
    assert result.ok and "Sanitizer" not in result.stderr, result.stderr[-4000:]
    assert result.tg_bytes == 0  # nothing went through the shim's TG_ARRAY
    assert paged.max_abs_error(out, paged.reference(inputs)) <= TOLERANCE[case.dtype]
