"""The two-pass (split-K) decode kernels, run on the CPU from MLX's generated source.

Same proof as the one-pass kernel (test_kernels_emulated.py): each case traces
the Metal text MLX would compile (CUDA: rebuilds cuda_kernel's text), runs
both passes in the emulator with one thread per lane and the checked
threadgroup arrays, and compares with `paged_attention_ref` (fp16 2e-3, fp32
1e-5, bf16 1.6e-2) and within half an ulp of the fp32 oracle. Pass 1 serves
all query heads of a KV head from one K/V read (GQA 1:1 to 8:1 here).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import pytest
from kernel_harness import emulator, metal_source, msl_lint, paged, two_pass
from kernel_harness.cases import make_inputs
from kernel_harness.two_pass import (
    TWO_PASS_CASES,
    TWO_PASS_CUDA_CASES,
    TWO_PASS_SANITIZER_CASES,
    TwoPassCase,
)

from engine.model.attention.gpu import abi
from engine.model.attention.gpu import two_pass as gpu_two_pass
from engine.model.attention.routes import TWO_PASS_MIN_TOKENS
from metal_kernels import kernel_header

TOLERANCE = {"float16": 2e-3, "bfloat16": 1.6e-2, "float32": 1e-5}
LONG = 4096  # cases past this many tokens run behind the `slow` marker (none now)


@pytest.fixture(scope="module")
def work_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("two_pass")


@pytest.fixture(scope="module")
def binaries(work_dir):
    metal = {c: two_pass.sources(c, make_inputs(c)) for c in TWO_PASS_CASES
             + TWO_PASS_SANITIZER_CASES}
    cuda = {c: two_pass.sources(c, make_inputs(c), "cuda") for c in TWO_PASS_CUDA_CASES}

    def flat(srcs):
        return [s for pair in srcs for s in (pair.split, pair.reduce)]

    san_metal = flat(metal[c] for c in TWO_PASS_SANITIZER_CASES)
    san_cuda = flat([cuda[TWO_PASS_CUDA_CASES[0]]])
    jobs = {
        ("metal", None): flat(metal[c] for c in TWO_PASS_CASES),
        ("cuda", None): flat(cuda.values()),
        **{("metal", s): san_metal for s in ("address", "thread", "undefined")},
        **{("cuda", s): san_cuda for s in ("address", "thread")},
    }
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {key: pool.submit(emulator.build, srcs, work_dir, sanitizer=key[1])
                   for key, srcs in jobs.items()}
        built = {key: f.result() for key, f in futures.items()}
    return built, {"metal": metal, "cuda": cuda}


def check(case, out, result, inputs) -> None:
    assert result.ok, f"emulator failed (rc={result.returncode}):\n{result.stderr[-4000:]}"
    err = paged.max_abs_error(out, paged.reference(inputs))
    assert err <= TOLERANCE[case.dtype], f"{case.id}: max abs error {err:.3g}"
    excess = paged.ulp_excess(out, paged.reference(inputs, fp32=True))
    assert excess <= 0.0, f"{case.id}: {excess:.3g} ulp beyond half an ulp of the fp32 oracle"


def _params(cases):
    for c in cases:
        marks = [pytest.mark.slow] if max(c.context_lens) > LONG else []
        yield pytest.param(c, id=c.id, marks=marks)


@pytest.mark.parametrize("case", list(_params(TWO_PASS_CASES)))
def test_two_pass_metal_matches_reference(case, binaries, work_dir):
    built, srcs = binaries
    inputs = make_inputs(case)
    out, result = two_pass.emulate(built["metal", None], srcs["metal"][case], case, inputs,
                                   work_dir, timeout_s=300)
    check(case, out, result, inputs)


@pytest.mark.parametrize("case", TWO_PASS_CUDA_CASES, ids=lambda c: c.id)
def test_two_pass_cuda_matches_reference(case, binaries, work_dir):
    built, srcs = binaries
    inputs = make_inputs(case)
    out, result = two_pass.emulate(built["cuda", None], srcs["cuda"][case], case, inputs,
                                   work_dir)
    check(case, out, result, inputs)


def _sanitizer_params():
    for san in ("address", "thread", "undefined"):
        for c in TWO_PASS_SANITIZER_CASES:
            yield pytest.param("metal", san, c, id=f"metal-{san}-{c.id}")
    for san in ("address", "thread"):
        c = TWO_PASS_CUDA_CASES[0]
        yield pytest.param("cuda", san, c, id=f"cuda-{san}-{c.id}")


@pytest.mark.parametrize(("backend", "sanitizer", "case"), list(_sanitizer_params()))
def test_two_pass_sanitizer_builds_are_clean(backend, sanitizer, case, binaries, work_dir):
    built, srcs = binaries
    inputs = make_inputs(case)
    out, result = two_pass.emulate(built[backend, sanitizer], srcs[backend][case], case,
                                   inputs, work_dir, timeout_s=300)
    assert "Sanitizer" not in result.stderr and "runtime error" not in result.stderr, (
        result.stderr[-6000:]
    )
    check(case, out, result, inputs)


def test_two_pass_cases_cover_the_matrix():
    cases = TWO_PASS_CASES
    assert len(cases) >= 20
    assert {c.dtype for c in cases} == {"float16", "bfloat16", "float32"}
    assert {c.num_q_heads // c.num_kv_heads for c in cases} >= set(range(1, 9))
    assert any(c.heads_per_group < c.num_q_heads // c.num_kv_heads for c in cases)
    # A context the engine routes to two-pass, with its partition size and simdgroups.
    assert any(max(c.context_lens) >= TWO_PASS_MIN_TOKENS
               and c.partition_tokens == gpu_two_pass.PARTITION_TOKENS
               and c.num_simdgroups == abi.NUM_SIMDGROUPS for c in cases)
    lens = [(n, c) for c in cases for n in c.context_lens]
    assert any(n % c.block_size for n, c in lens)  # partial last block
    assert any(n % c.partition_tokens for n, c in lens)  # partial last partition
    assert any(c.partition_tokens % c.block_size for c in cases)  # partitions cut blocks
    # A short sequence that ends partitions before the batch's longest.
    assert any(min(c.context_lens) + c.partition_tokens <= max(c.context_lens) for c in cases)
    assert any(c.k_quant or c.v_quant for c in cases) and 1 in [n for n, _ in lens]


def test_heads_per_group_and_partitions():
    assert [gpu_two_pass.heads_per_group(h, 1) for h in (1, 2, 3, 4, 5, 6, 7, 8)] == list(
        range(1, 9))
    assert gpu_two_pass.heads_per_group(32, 2) == 8  # ratio 16: two groups of 8
    assert gpu_two_pass.heads_per_group(12, 1) == 6 and gpu_two_pass.heads_per_group(9, 1) == 3
    assert gpu_two_pass.num_partitions([1, 512, 513], 512) == 2


def test_generated_split_and_reduce_signatures():
    case = TwoPassCase("float16", 64, 16, 8, 2, (20, 40))
    srcs = two_pass.sources(case, make_inputs(case))
    split = {p.name: p for p in srcs.split.params}
    assert [p.name for p in srcs.split.params if p.kind in ("input", "output")] == [
        *abi.INPUT_NAMES, *gpu_two_pass.SPLIT_OUTPUT_NAMES]
    assert split["part_out"].ctype == split["part_max"].ctype == "device float*"
    assert {p.name for p in srcs.split.params if p.kind == "shape"} == {
        "queries_shape", "k_pool_shape", "block_tables_shape"}
    assert srcs.split.template_call == "<float16_t, 64, 16, 2, 0, 0, 0, 0, 4, 32>"
    reduce = {p.name: p for p in srcs.reduce.params}
    assert {p.name for p in srcs.reduce.params if p.kind == "shape"} == {
        "part_max_shape", "attn_sinks_shape"}
    assert reduce["out"].ctype == "device float16_t*"
    assert srcs.reduce.template_call == "<float16_t, 64, 32>"
    # No input name ends another, so MLX's "<name>_shape" search cannot misfire.
    names = gpu_two_pass.REDUCE_INPUT_NAMES
    assert not [(a, b) for a in names for b in names if a != b and b.endswith(a)]


@pytest.mark.parametrize("case", [TWO_PASS_CASES[0], TWO_PASS_CASES[19]], ids=lambda c: c.id)
def test_two_pass_msl_lint_is_clean(case):
    srcs = two_pass.sources(case, make_inputs(case))
    for src in (srcs.split, srcs.reduce):
        assert msl_lint.lint_msl(src.text) == []
    for body in (two_pass.SPLIT_BODY, two_pass.REDUCE_BODY):
        assert msl_lint.lint_msl(kernel_header("metal") + body) == []


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_two_pass_resources_fit_apple_limits(head_dim):
    template = {"NSG": abi.NUM_SIMDGROUPS, "D": head_dim}
    text = kernel_header("metal") + two_pass.SPLIT_BODY
    assert msl_lint.threadgroup_bytes(text, template) <= msl_lint.MAX_THREADGROUP_BYTES
    q = mx.zeros((2, 32, 1, head_dim), dtype=mx.float16)
    split = gpu_two_pass.split_launch(q, 64, qpg=8)
    reduce = gpu_two_pass.reduce_launch(q)
    for launch in (split, reduce):
        threads = launch["threadgroup"][0]
        assert threads <= msl_lint.MAX_THREADS_PER_THREADGROUP and threads % 32 == 0
    assert split["grid"] == (256 * 64, 4, 2) and reduce["grid"] == (head_dim, 32, 2)


def test_two_pass_generated_text_is_traced_once_per_variant():
    """Distinct variants get distinct kernel names (a binary holds many)."""
    a, b = TWO_PASS_CASES[0], TWO_PASS_CASES[1]
    sa = two_pass.sources(a, make_inputs(a))
    sb = two_pass.sources(b, make_inputs(b))
    assert len({sa.split.name, sa.reduce.name, sb.split.name, sb.reduce.name}) == 4
    assert metal_source.generated_metal_source(**make_inputs(a))  # the one-pass still traces
