"""Kernel sources without a GPU: MLX's generated Metal signature (golden), the
CUDA text, MSL lint and resource limits, and the engine-side helpers."""

from __future__ import annotations

import shutil
import subprocess

import mlx.core as mx
import pytest
from kernel_harness import emulator, metal_source, msl_lint, paged
from kernel_harness.cases import Case, make_inputs

from engine.model import backend
from engine.model.attention.gpu import abi, one_pass
from metal_kernels import (
    MLX_RANGE,
    kernel_header,
    mlx_range_text,
    mlx_version_checked,
    read_source,
)

BODY = read_source("paged_attention.metal")
MSL_TEXT = kernel_header("metal") + BODY

# What MLX 0.32 generates for fp16, D=64, block size 16, B=2, 5-column tables:
# plain pools (KB = VB = 0), so the scales inputs are 1-element placeholders
# that MLX binds as constant memory.
GOLDEN_NAME = (
    "custom_kernel_paged_decode__float16_t_64_16_8_0_0_0_0_"
    "float16_t_float16_t_float16_t_int32_t_int32_tc_floatc_"
    "float16_tc_float16_tc_float16_tc_float16_tc_int32_tc_floatc_float16_t"
)
GOLDEN_SIGNATURE = f"""template <typename T, int D, int BS, int NSG, int KB, int KG, int VB, int VG>
[[kernel]] void {GOLDEN_NAME}(
  const device float16_t* queries [[buffer(0)]],
  const constant int* queries_shape [[buffer(1)]],
  const device float16_t* k_pool [[buffer(2)]],
  const constant int* k_pool_shape [[buffer(3)]],
  const device float16_t* v_pool [[buffer(4)]],
  const device int32_t* block_tables [[buffer(5)]],
  const constant int* block_tables_shape [[buffer(6)]],
  const constant int32_t* context_lens [[buffer(7)]],
  const constant float* scale [[buffer(8)]],
  const constant float16_t* k_scales [[buffer(9)]],
  const constant float16_t* k_biases [[buffer(10)]],
  const constant float16_t* v_scales [[buffer(11)]],
  const constant float16_t* v_biases [[buffer(12)]],
  const constant int32_t* attn_window [[buffer(13)]],
  const constant float* attn_sinks [[buffer(14)]],
  const constant int* attn_sinks_shape [[buffer(15)]],
  device float16_t* out [[buffer(16)]],
  uint simdgroup_index_in_threadgroup [[simdgroup_index_in_threadgroup]],
  uint thread_index_in_simdgroup [[thread_index_in_simdgroup]],
  uint3 threadgroup_position_in_grid [[threadgroup_position_in_grid]]) {{
"""


def _golden_inputs(batch: int = 2, dtype=mx.float16, kv_dtype=None, head_dim: int = 64):
    return {
        "queries": mx.zeros((batch, 4, 1, head_dim), dtype=dtype),
        "k_pool": mx.zeros((2, 10, 16, head_dim), dtype=kv_dtype or dtype),
        "v_pool": mx.zeros((2, 10, 16, head_dim), dtype=kv_dtype or dtype),
        "block_tables": mx.zeros((batch, 5), dtype=mx.int32),
        "context_lens": [20] * batch,
        "scale": 0.125,
    }


def drift(what: str) -> str:
    """The failure message when MLX's generated source no longer matches the golden text."""
    return (
        f"MLX {mx.__version__} generates a different {what} than the golden text checked "
        f"against {mlx_range_text()} (pinned in pyproject.toml). The emulator's parser and "
        f"the CUDA wrapper re-implementation may no longer match what this MLX compiles: "
        f"re-check them against MLX {mx.__version__}'s custom_kernel sources, then update "
        f"the golden text and metal_kernels.MLX_RANGE together."
    )


def test_golden_metal_signature():
    text = metal_source.generated_metal_source(**_golden_inputs())
    assert GOLDEN_SIGNATURE in text, drift("kernel signature") + "\n" + text[:3000]
    # Header first, then the signature, the body verbatim, and the instantiation.
    assert text.index(kernel_header("metal").strip()) < text.index(GOLDEN_SIGNATURE), drift(
        "header placement"
    )
    assert BODY.strip() in text, drift("kernel body")
    assert (
        f"decltype({GOLDEN_NAME}<float16_t, 64, 16, 8, 0, 0, 0, 0>) "
        f"{GOLDEN_NAME}<float16_t, 64, 16, 8, 0, 0, 0, 0>;"
    ) in text, drift("template instantiation")


def test_installed_mlx_is_in_the_checked_range():
    assert mlx_version_checked(mx.__version__), (
        f"MLX {mx.__version__} is outside {mlx_range_text()}, the range the golden kernel "
        f"source was checked against; install a pinned version or re-check the golden tests"
    )


def test_pyproject_pins_the_checked_range():
    from pathlib import Path

    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    pins = [line for line in pyproject.splitlines() if line.strip().startswith('"mlx')
            and "mlx-lm" not in line]
    assert len(pins) == 2, pins  # the Linux CPU extra and macOS
    for line in pins:
        assert ",".join(MLX_RANGE) in line, f"{line.strip()} does not pin {mlx_range_text()}"


@pytest.mark.parametrize(
    ("version", "inside"),
    [("0.32.0", True), ("0.32.4", True), ("0.32.10.dev3", True), ("0.31.9", False),
     ("0.33.0", False), ("1.0.0", False)],
)
def test_mlx_version_range_check(version, inside):
    assert mlx_version_checked(version) is inside


def test_generated_signature_tracks_sizes_and_dtypes():
    # 8+ sequences: lengths move from constant to device memory.
    src = emulator.parse_metal(
        metal_source.generated_metal_source(
            **_golden_inputs(batch=9, dtype=mx.bfloat16, kv_dtype=mx.float32, head_dim=128)
        ),
        abi.INPUT_NAMES,
        abi.OUTPUT_NAMES,
    )
    params = {p.name: p for p in src.params}
    assert [p.name for p in src.params if p.kind in ("input", "output")] == [
        *abi.INPUT_NAMES,
        *abi.OUTPUT_NAMES,
    ]
    assert params["queries"].ctype == "const device bfloat16_t*"
    assert params["k_pool"].ctype == "const device float*"
    assert params["context_lens"].ctype == "const device int32_t*"
    assert params["block_tables"].ctype == "const device int32_t*"
    assert params["scale"].ctype == "const constant float*"
    assert params["out"].ctype == "device bfloat16_t*"
    # Only the shapes the body reads; no strides/ndim parameters.
    assert {p.name for p in src.params if p.kind in ("shape", "strides", "ndim")} == {
        "queries_shape",
        "k_pool_shape",
        "block_tables_shape",
        "attn_sinks_shape",  # one placeholder sink or one per query head
    }
    assert src.template_call == "<bfloat16_t, 128, 16, 8, 0, 0, 0, 0>"


def test_cuda_source_shape():
    case = Case("bfloat16", 128, 16, 4, 2, (5, 9))
    src = paged.cuda_source(case, make_inputs(case))
    assert src.name == "custom_kernel_paged_decode_bfloat16_t_128_16_2_0_0_0_0"
    for line in (
        "  using T = __nv_bfloat16;",
        "  constexpr int D = 128;",
        "  constexpr int BS = 16;",
        "  constexpr int NSG = 2;",
        "  constexpr int KB = 0;",
        "  constexpr int VG = 0;",
        "    const __grid_constant__ Shape queries_shape,",
        "    const float* scale,",
        "    const __half* k_scales,",
        "    __nv_bfloat16* out) {",
    ):
        assert line in src.text
    assert src.text.index("KVCHAT_CUDA_BACKEND_H") < src.text.index("namespace mlx::core::cu")


NVCC_CASES = [
    Case("float16", 128, 16, 4, 2, (5, 9)),
    Case("bfloat16", 96, 16, 4, 2, (5, 9), k_quant=(8, 32), v_quant=(4, 32)),
    Case("float32", 128, 16, 4, 1, (5, 9), k_quant=(4, 64)),
]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs the CUDA toolkit (nvcc)")
def test_cuda_source_compiles_with_nvcc(tmp_path):
    """Device-compile the CUDA texts (MLX headers replaced by a minimal stand-in).

    One translation unit for plain and quantized variants: the kernel names
    differ and the headers are include-guarded, so one nvcc run checks all.
    """
    cu = tmp_path / "paged_decode.cu"
    cu.write_text("\n".join(paged.cuda_source(c, make_inputs(c)).text for c in NVCC_CASES))
    include = emulator.HARNESS_DIR / "nvcc_include"
    proc = subprocess.run(
        [
            "nvcc",
            "-std=c++17",
            "-arch=sm_80",
            "-I",
            str(include),
            "-c",
            str(cu),
            "-o",
            str(tmp_path / "paged_decode.o"),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]


def test_msl_lint_is_clean():
    assert msl_lint.lint_msl(MSL_TEXT) == []


@pytest.mark.parametrize(
    "case",
    [
        Case("float16", 64, 16, 4, 2, (9, 17)),
        Case("float16", 96, 16, 4, 2, (9, 17), k_quant=(8, 32), v_quant=(4, 32)),
        Case("bfloat16", 128, 8, 4, 1, (9,), v_quant=(4, 128)),
    ],
    ids=lambda c: c.id,
)
def test_generated_msl_lint_is_clean(case):
    """The whole text MLX would compile, plain and quantized variants alike."""
    text = metal_source.generated_metal_source(
        **make_inputs(case), num_simdgroups=case.num_simdgroups
    )
    assert msl_lint.lint_msl(text) == []


def test_msl_lint_catches_what_metal_rejects():
    bad = """
    inline float f(float x) { return g(x); }
    inline float g(float x) { return f(x) * 2.0f; }
    void k(const device float* a, float* b) {
      double d = 1;
      float m = std::max(1.0f, 2.0f);
      printf("x");
      T* p = nullptr;
    }
    """
    text = "\n".join(msl_lint.lint_msl(bad))
    for expected in ("double", "std::", "printf", "'float* b'", "'T* p'", "recursion through f"):
        assert expected in text
    assert "const device float* a" not in text


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_resources_fit_apple_limits(head_dim):
    template = {"NSG": abi.NUM_SIMDGROUPS, "D": head_dim}
    assert msl_lint.threadgroup_bytes(MSL_TEXT, template) <= msl_lint.MAX_THREADGROUP_BYTES
    queries = mx.zeros((3, 8, 1, head_dim))
    grid, threadgroup = one_pass.launch_dims(queries)
    threads = threadgroup[0] * threadgroup[1] * threadgroup[2]
    assert threads <= msl_lint.MAX_THREADS_PER_THREADGROUP
    assert threads % abi.SIMD_WIDTH == 0  # whole simdgroups: simd_sum sees 32 lanes
    assert grid == (threads, 8, 3)


def test_body_avoids_accidental_shape_params():
    """MLX adds `<input>_strides`/`_ndim`/`_shape` params on a substring match."""
    used = {
        f"{n}_{s}"
        for n in abi.INPUT_NAMES
        for s in ("shape", "strides", "ndim")
        if f"{n}_{s}" in BODY
    }
    assert used == {"queries_shape", "k_pool_shape", "block_tables_shape", "attn_sinks_shape"}
    # No input name ends another, so "<a>_shape" is never inside "<b>_shape".
    names = abi.INPUT_NAMES
    assert not [(a, b) for a in names for b in names if a != b and b.endswith(a)]


def test_read_source_and_headers():
    assert "simd_sum" in read_source("paged_attention.metal")
    assert kernel_header("metal").index("KVCHAT_METAL_BACKEND_H") < kernel_header("metal").index(
        "KVCHAT_COMMON_H"
    )
    with pytest.raises(ValueError):
        kernel_header("vulkan")


def test_backend_detection_and_support():
    expected = "metal" if mx.metal.is_available() else "cuda" if mx.cuda.is_available() else None
    assert backend.kernel_backend() == expected
    q = mx.zeros((2, 8, 1, 64), dtype=mx.float16)
    pool = mx.zeros((2, 4, 16, 64), dtype=mx.float16)
    assert abi.supports(q, pool)
    assert not abi.supports(mx.zeros((2, 8, 3, 64), dtype=mx.float16), pool)  # prefill
    assert not abi.supports(mx.zeros((2, 8, 1, 80), dtype=mx.float16), pool)  # D % 32
    assert not abi.supports(q, mx.zeros((3, 4, 16, 64), dtype=mx.float16))  # 8 % 3


@pytest.mark.skipif(backend.kernel_backend() is not None, reason="a GPU back-end exists")
def test_decode_without_gpu_raises():
    case = Case("float32", 64, 16, 2, 1, (5,))
    with pytest.raises(RuntimeError):
        one_pass.paged_decode_attention(**make_inputs(case))


def test_cuda_kernel_is_not_constructed_without_cuda():
    if mx.cuda.is_available():
        pytest.skip("CUDA back-end present")
    with pytest.raises(RuntimeError):
        one_pass.make_paged_decode_kernel("cuda")
