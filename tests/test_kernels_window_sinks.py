"""Sliding windows and attention sinks in the one kernel body (Metal and CUDA, one- and
two-pass), emulated on the CPU from MLX's generated source like the plain cases.

A case's `AttentionSpec` carries the window (the query sees its last W keys) and the
sinks (one logit per query head joining the softmax without a value); the kernels
must match the reference with the same spec within the plain cases' bounds, and
round once from fp32. Mutants: the window one key short or one key long, the sink
left out of the softmax (one pass, and pass 2 of two), pass 1 ignoring the window.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import numpy as np
import pytest
from kernel_harness import emulator, paged, two_pass
from kernel_harness.cases import Case, make_inputs
from kernel_harness.two_pass import REDUCE_BODY, SPLIT_BODY, TwoPassCase
from test_kernels_emulated import TOLERANCE
from test_kernels_emulated import check_case as check

from engine.model.attention import AttentionSpec

# (case, window, sinks): ragged lengths around the window, GQA, windows of 1 and wider
# than every sequence, sinks with and without a window, every dtype.
ONE_PASS = [
    (Case("float16", 64, 16, 4, 2, (37, 5, 16)), 8, True),
    (Case("float32", 128, 8, 6, 2, (50, 23)), 20, False),
    (Case("bfloat16", 64, 16, 4, 4, (37, 5)), None, True),
    (Case("float32", 64, 8, 3, 1, (33, 1), num_simdgroups=4), 1, True),
    (Case("float16", 64, 32, 8, 8, (31, 2), num_simdgroups=4), 64, True),
    (Case("float32", 64, 16, 2, 2, (40,)), 17, False),
]
CUDA = ONE_PASS[:2]
TWO_PASS = [  # windows spanning, starting inside, and skipping whole partitions
    (TwoPassCase("float16", 64, 8, 8, 2, (45, 12), partition_tokens=16, qpg=2), 20, True),
    (TwoPassCase("float32", 64, 8, 4, 1, (70,), partition_tokens=16), 33, False),
    (TwoPassCase("float32", 128, 16, 6, 2, (50, 7), partition_tokens=16), None, True),
]


def spec_inputs(case, window: int | None, sinks: bool) -> dict:
    inputs = make_inputs(case)
    rng = np.random.default_rng(case.seed + 7)
    # in the queries' dtype, as a model's own parameter would be
    logits = mx.array(2.0 * rng.standard_normal(case.num_q_heads).astype(np.float32))
    logits = logits.astype(inputs["queries"].dtype)
    inputs["scale"] = AttentionSpec(inputs["scale"], window, logits if sinks else None)
    return inputs


def ident(param) -> str:
    case, window, sinks = param
    return f"{case.id}-w{window}-{'sinks' if sinks else 'nosinks'}"


def _body(old: str, new: str) -> str:
    return paged.mutate(old, new)


ONE_PASS_MUTANTS = {
    "window_one_short": _body("num_tokens - win : 0;", "num_tokens - win + 1 : 0;"),
    "window_one_long": _body("num_tokens - win : 0;", "num_tokens - win - 1 : 0;"),
    "sink_ignored": _body("float denom = pa_exp(sink - g_max);", "float denom = 0.0f;"),
}
TWO_PASS_MUTANTS = {
    "reduce_sink_ignored": (None, paged.mutate("float denom = pa_exp(sink - g_max);",
                                               "float denom = 0.0f;", REDUCE_BODY)),
    "split_window_one_long": (paged.mutate("num_tokens - win : 0;", "num_tokens - win - 1 : 0;",
                                           SPLIT_BODY), None),
}
MUTANT_CASE = ONE_PASS[0]
TWO_PASS_MUTANT_CASE = TWO_PASS[0]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Every source of this module, compiled in a few emulator builds at once."""
    work = tmp_path_factory.mktemp("window_sinks")
    metal = {ident(p): paged.metal_source(p[0], spec_inputs(*p)) for p in ONE_PASS}
    cuda = {ident(p): paged.cuda_source(p[0], spec_inputs(*p)) for p in CUDA}
    mutants = {name: paged.metal_source(MUTANT_CASE[0], spec_inputs(*MUTANT_CASE), body=body,
                                        name=f"mut_{name}")
               for name, body in ONE_PASS_MUTANTS.items()}
    twos = {ident(p): two_pass.sources(p[0], spec_inputs(*p)) for p in TWO_PASS}
    two_mutants = {
        name: two_pass.sources(TWO_PASS_MUTANT_CASE[0], spec_inputs(*TWO_PASS_MUTANT_CASE),
                               split_body=split, reduce_body=reduce,
                               names=(f"split_{name}", f"reduce_{name}"))
        for name, (split, reduce) in TWO_PASS_MUTANTS.items()}
    two_srcs = [s for t in [*twos.values(), *two_mutants.values()] for s in (t.split, t.reduce)]
    jobs = {"metal": [*metal.values(), *mutants.values()], "cuda": list(cuda.values()),
            "two": two_srcs}
    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = {k: pool.submit(emulator.build, srcs, work) for k, srcs in jobs.items()}
        binaries = {k: f.result() for k, f in futures.items()}
    return work, binaries, metal, cuda, mutants, twos, two_mutants


@pytest.mark.parametrize("param", ONE_PASS, ids=ident)
def test_one_pass_metal_window_and_sinks(param, built):
    work, binaries, metal, *_ = built
    case, inputs = param[0], spec_inputs(*param)
    out, result = paged.emulate(binaries["metal"], metal[ident(param)], case, inputs, work)
    check(case, out, result, inputs)


@pytest.mark.parametrize("param", CUDA, ids=ident)
def test_one_pass_cuda_window_and_sinks(param, built):
    work, binaries, _, cuda, *_ = built
    case, inputs = param[0], spec_inputs(*param)
    out, result = paged.emulate(binaries["cuda"], cuda[ident(param)], case, inputs, work)
    check(case, out, result, inputs)


@pytest.mark.parametrize("param", TWO_PASS, ids=ident)
def test_two_pass_metal_window_and_sinks(param, built):
    work, binaries, *_, twos, _ = built
    case, inputs = param[0], spec_inputs(*param)
    out, result = two_pass.emulate(binaries["two"], twos[ident(param)], case, inputs, work)
    check(case, out, result, inputs)


@pytest.mark.parametrize("name", sorted(ONE_PASS_MUTANTS))
def test_one_pass_mutant_is_caught(name, built):
    work, binaries, _, _, mutants, *_ = built
    case, inputs = MUTANT_CASE[0], spec_inputs(*MUTANT_CASE)
    out, result = paged.emulate(binaries["metal"], mutants[name], case, inputs, work)
    assert result.ok and out is not None
    err = paged.max_abs_error(out, paged.reference(inputs))
    assert err > 10 * TOLERANCE[case.dtype], f"mutant {name} passed (error {err:.3g})"


@pytest.mark.parametrize("name", sorted(TWO_PASS_MUTANTS))
def test_two_pass_mutant_is_caught(name, built):
    work, binaries, *_, two_mutants = built
    case, inputs = TWO_PASS_MUTANT_CASE[0], spec_inputs(*TWO_PASS_MUTANT_CASE)
    out, result = two_pass.emulate(binaries["two"], two_mutants[name], case, inputs, work)
    assert result.ok and out is not None
    err = paged.max_abs_error(out, paged.reference(inputs))
    assert err > 10 * TOLERANCE[case.dtype], f"mutant {name} passed (error {err:.3g})"


def test_plain_spec_is_the_plain_kernel_input():
    """Without window or sinks the kernel gets 0 and one NO_SINK: the plain computation."""
    from engine.model.attention.gpu import abi

    inputs = make_inputs(ONE_PASS[0][0])
    args = dict(zip(abi.INPUT_NAMES, abi.kernel_inputs(**inputs), strict=True))
    assert args["attn_window"].tolist() == [0]
    assert args["attn_sinks"].tolist() == [abi.NO_SINK]
