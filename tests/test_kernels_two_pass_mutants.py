"""Deliberately broken two-pass kernels: the emulator harness must catch each one.

- merge without the max rescale (pass 2 weights every partition 1): wrong numbers;
- pass 2 reads every partition, also those past a short sequence's end: NaN
  (unwritten partials), i.e. wrong numbers;
- partition end one token late: tokens counted twice, wrong numbers;
- wrong GQA head mapping (kv_head = head group % KV heads, in bounds): wrong numbers;
- GQA ratio confused with the heads per threadgroup (kv_head = first / QPG):
  an AddressSanitizer overflow past the pool;
- every head of a group reads the group's first query: wrong numbers;
- the merge barrier with mem_flags::mem_none: the checked threadgroup arrays;
- the barrier before the next head's merge dropped: a ThreadSanitizer race
  (write-after-read, which only TSan sees) in the real TG_ARRAY mode;
- CUDA: the unscaled merge compiled as CUDA: wrong numbers.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from kernel_harness import emulator, paged
from kernel_harness.cases import make_inputs
from kernel_harness.two_pass import REDUCE_BODY, SPLIT_BODY, TwoPassCase, emulate, sources

# Ragged, several partitions, GQA 4:1 served as two groups of 2 (qpg < ratio).
CASE = TwoPassCase("float16", 64, 8, 8, 2, (45, 12), partition_tokens=16, qpg=2)
TSAN_CASE = TwoPassCase("float32", 64, 8, 4, 1, (20,), partition_tokens=8)
EXIT_MEM_ORDER = 89


def _split(old: str, new: str) -> str:
    return paged.mutate(old, new, SPLIT_BODY)


def _reduce(old: str, new: str) -> str:
    return paged.mutate(old, new, REDUCE_BODY)


MERGE_BARRIER = "    threadgroup_barrier(mem_flags::mem_threadgroup);\n\n    float g_max"
NEXT_HEAD_BARRIER = (
    "    // The next head overwrites the arrays everyone just read.\n"
    "    threadgroup_barrier(mem_flags::mem_threadgroup);\n"
)
MUTANTS = {
    # name: (split body, reduce body, sanitizer, TG mode)
    "merge_unscaled": (None, _reduce("pa_exp(part_max[slot] - g_max)", "1.0f"), None, "checked"),
    "reduce_all_partitions": (
        None, _reduce("(num_tokens + PS - 1) / PS", "part_max_shape[0]"), None, "checked"),
    "partition_end_late": (
        _split("(part + 1) * PS < num_tokens ? (part + 1) * PS", "(part + 1) * PS + 1 < "
               "num_tokens ? (part + 1) * PS + 1"), None, None, "checked"),
    "gqa_head_mapping": (
        _split("first_head / (num_q_heads / num_kv_heads)", "head_group % num_kv_heads"), None,
        None, "checked"),
    "gqa_ratio_confused_asan": (
        _split("first_head / (num_q_heads / num_kv_heads)", "first_head / QPG"), None,
        "address", "checked"),
    "query_head_fixed": (
        _split("(int64_t(seq) * num_q_heads + first_head + h) * D",
               "(int64_t(seq) * num_q_heads + first_head) * D"), None, None, "checked"),
    "merge_mem_none": (
        _split(MERGE_BARRIER, MERGE_BARRIER.replace("mem_threadgroup", "mem_none")), None, None,
        "checked"),
    "no_next_head_barrier": (_split(NEXT_HEAD_BARRIER, ""), None, "thread", "real"),
}
WRONG_NUMBERS = ["merge_unscaled", "reduce_all_partitions", "partition_end_late",
                 "gqa_head_mapping", "query_head_fixed", "cuda_merge_unscaled"]


@pytest.fixture(scope="module")
def work_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("two_pass_mutants")


@pytest.fixture(scope="module")
def mutants(work_dir):
    """name -> (binary, sources, case).

    The plain checked-mode mutants edit only the bodies and have distinct kernel
    names, so they share one binary (the driver runs one kernel by name); each
    sanitizer, TG mode or backend gets a binary of its own.
    """
    jobs = {}
    for i, (name, (split, reduce, san, mode)) in enumerate(MUTANTS.items()):
        case = TSAN_CASE if name == "no_next_head_barrier" else CASE
        srcs = sources(case, make_inputs(case), split_body=split, reduce_body=reduce,
                       names=(f"mut_split{i}", f"mut_reduce{i}"))
        jobs[name] = (srcs, case, san, mode)
    cuda = sources(CASE, make_inputs(CASE), "cuda", reduce_body=MUTANTS["merge_unscaled"][1],
                   names=("mut_split_cu", "mut_reduce_cu"))
    jobs["cuda_merge_unscaled"] = (cuda, CASE, None, "checked")
    groups: dict[tuple, list[str]] = {}
    for name, (srcs, _, san, mode) in jobs.items():
        groups.setdefault((srcs.split.backend, san, mode), []).append(name)
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {
            key: pool.submit(emulator.build,
                             [s for n in names for s in (jobs[n][0].split, jobs[n][0].reduce)],
                             work_dir, sanitizer=key[1], tg_mode=key[2])
            for key, names in groups.items()
        }
        binaries = {n: futures[key].result() for key, names in groups.items() for n in names}
    return {name: (binaries[name], srcs, case) for name, (srcs, case, _, _) in jobs.items()}


def _run(mutants, work_dir, name, **options):
    binary, srcs, case = mutants[name]
    inputs = make_inputs(case)
    out, result = emulate(binary, srcs, case, inputs, work_dir, **options)
    return out, result, inputs


@pytest.mark.parametrize("name", WRONG_NUMBERS)
def test_mutant_gives_wrong_numbers(name, mutants, work_dir):
    out, result, inputs = _run(mutants, work_dir, name)
    assert result.ok, result.stderr[-2000:]  # in bounds: only the numbers show it
    err = paged.max_abs_error(out, paged.reference(inputs))
    assert not err <= 0.05, f"{name}: max abs error {err:.3g} (NaN counts as caught)"


def test_gqa_ratio_confusion_reads_past_the_pool_under_asan(mutants, work_dir):
    _, result, _ = _run(mutants, work_dir, "gqa_ratio_confused_asan", timeout_s=300)
    assert not result.ok
    assert "AddressSanitizer: heap-buffer-overflow" in result.stderr, result.stderr[-3000:]


def test_merge_barrier_without_mem_threadgroup_fails(mutants, work_dir):
    _, result, _ = _run(mutants, work_dir, "merge_mem_none")
    assert result.returncode == EXIT_MEM_ORDER, result.stderr[-2000:]
    assert "no barrier with mem_flags::mem_threadgroup" in result.stderr


def test_missing_next_head_barrier_is_a_tsan_race(mutants, work_dir):
    _, result, _ = _run(mutants, work_dir, "no_next_head_barrier", timeout_s=300)
    assert "ThreadSanitizer: data race" in result.stderr, result.stderr[-3000:]
    assert "tg_" in result.stderr
