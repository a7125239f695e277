"""Paged decode attention under the emulator: sources, launches, error metrics."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np

from engine.kvcache.quantized_blocks import QuantizedBlocks
from engine.model.attention.gpu import abi, one_pass
from engine.model.attention.reference import paged_attention_ref
from metal_kernels import kernel_header, read_source

from . import emulator
from .cases import Case
from .metal_source import generated_metal_source

BODY = read_source("paged_attention.metal")


def mutate(old: str, new: str, body: str = BODY) -> str:
    """The kernel body (or other source text) with one exact edit (fails if the text moved)."""
    assert body.count(old) == 1, f"mutation anchor not found once: {old!r}"
    return body.replace(old, new)


def mutate_header(old: str, new: str, backend: str = "metal") -> str:
    """`backend`'s kernel header (backend header + common.h) with one exact edit."""
    return mutate(old, new, kernel_header(backend))


def metal_source(
    case: Case,
    inputs: dict,
    *,
    body: str | None = None,
    header: str | None = None,
    name: str = one_pass.KERNEL_NAME,
) -> emulator.KernelSource:
    text = generated_metal_source(
        **inputs, body=body, header=header, name=name, num_simdgroups=case.num_simdgroups
    )
    return emulator.parse_metal(text, abi.INPUT_NAMES, abi.OUTPUT_NAMES)


def cuda_source(
    case: Case,
    inputs: dict,
    *,
    body: str | None = None,
    header: str | None = None,
    name: str = one_pass.KERNEL_NAME,
) -> emulator.KernelSource:
    args = abi.kernel_inputs(**inputs)
    template = abi.template_args(
        inputs["queries"], inputs["k_pool"], inputs["v_pool"], num_simdgroups=case.num_simdgroups
    )
    return emulator.cuda_generated_source(
        name,
        abi.INPUT_NAMES,
        args,
        abi.OUTPUT_NAMES,
        [args[0].dtype],
        BODY if body is None else body,
        kernel_header("cuda") if header is None else header,
        template,
    )


def emulate(
    binary: Path,
    src: emulator.KernelSource,
    case: Case,
    inputs: dict,
    work_dir: Path,
    **run_options: object,
) -> tuple[mx.array | None, emulator.RunResult]:
    """Launch the kernel as `one_pass` would; (output or None, run result)."""
    args = abi.kernel_inputs(**inputs)
    queries = args[0]
    grid, threadgroup = one_pass.launch_dims(queries, num_simdgroups=case.num_simdgroups)
    result = emulator.run(
        binary,
        src,
        dict(zip(abi.INPUT_NAMES, args, strict=True)),
        {"out": (queries.shape, queries.dtype)},
        grid,
        threadgroup,
        work_dir,
        **run_options,
    )
    if not result.ok:
        return None, result
    return emulator.to_array(result.outputs[0], queries.shape, queries.dtype), result


def dense_pool(pool: mx.array | QuantizedBlocks) -> mx.array:
    """A pool as plain rows: a quantized one dequantized (mx.dequantize, scales' dtype).

    On the CPU stream: the kernel reproduces the CPU's float16 arithmetic
    (round scale * q, then round + bias), which a GPU build of mx.dequantize
    may fuse into one rounding.
    """
    if isinstance(pool, QuantizedBlocks):
        with mx.stream(mx.cpu):
            return pool.gather(mx.arange(pool.shape[1]))
    return pool


def reference(inputs: dict, *, fp32: bool = False) -> mx.array:
    """The contract's reference; with fp32=True on the same values upcast (the oracle).

    For a quantized pool "the same values" are its dequantized rows, which the
    kernel reproduces exactly before accumulating in fp32.
    """
    if not fp32:
        return paged_attention_ref(**inputs)
    up = {
        k: dense_pool(v).astype(mx.float32) if k in ("queries", "k_pool", "v_pool") else v
        for k, v in inputs.items()
    }
    return paged_attention_ref(**up)


def max_abs_error(a: mx.array, b: mx.array) -> float:
    return mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item()


def ulp_excess(out: mx.array, oracle: mx.array) -> float:
    """max(|out - oracle| / ulp_out(oracle)) - 0.5, with a 1e-5 absolute allowance.

    A kernel that accumulates in fp32 and rounds once is within half an ulp of
    the fp32 oracle (plus fp32 summation-order noise), so this stays <= 0.
    """
    mant = {mx.float16: 10, mx.bfloat16: 7, mx.float32: 23}[out.dtype]
    ref = np.asarray(oracle.astype(mx.float32))
    got = np.asarray(out.astype(mx.float32))
    exponent = np.floor(np.log2(np.maximum(np.abs(ref), 2.0**-14)))
    ulp = 2.0 ** (exponent - mant)
    excess = (np.abs(got - ref) - 1e-5) / ulp - 0.5
    return float(excess.max())
