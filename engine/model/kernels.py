"""Custom GPU kernels: paged decode attention on Metal or CUDA, built once.

The kernel bodies live in `metal_kernels/`; the pure-MLX reference (CPU
fallback and test oracle) is `engine.model.paged_attention.paged_attention_ref`.
Prefill (L > 1) stays on the reference path.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx

from engine.model import memory
from metal_kernels import kernel_header, read_source

# Tiling: NUM_SIMDGROUPS simdgroups of SIMD_WIDTH lanes per (query head, sequence).
SIMD_WIDTH = 32
NUM_SIMDGROUPS = 8
MAX_THREADS_PER_GROUP = 1024
KERNEL_NAME = "paged_decode"
INPUT_NAMES = ["queries", "k_pool", "v_pool", "block_tables", "context_lens", "scale"]
OUTPUT_NAMES = ["out"]
SUPPORTED_DTYPES = (mx.float16, mx.bfloat16, mx.float32)

KernelFn = Callable[..., list[mx.array]]


def kernel_available() -> str | None:
    """Return "metal" or "cuda" when this MLX build can run custom kernels, else None."""
    backend = memory.backend()  # the one backend probe
    return backend if backend in ("metal", "cuda") else None


def supports(queries: mx.array, k_pool: mx.array) -> bool:
    """Whether `paged_decode_attention` handles these shapes and dtypes."""
    _, num_q_heads, L, D = queries.shape
    num_kv_heads = k_pool.shape[0]
    return (
        L == 1
        and D % SIMD_WIDTH == 0
        and num_q_heads % num_kv_heads == 0
        and queries.dtype in SUPPORTED_DTYPES
        and k_pool.dtype in SUPPORTED_DTYPES
    )


def make_paged_decode_kernel(backend: str, *, body: str | None = None, name: str = KERNEL_NAME):
    """Construct (not compile) the kernel; `body` overrides the source (test mutants)."""
    source = read_source("paged_attention.metal") if body is None else body
    if backend not in ("metal", "cuda"):
        raise ValueError(f"unknown kernel backend {backend!r}")
    # Construction raises on builds without the CUDA back-end: check first.
    if backend == "cuda" and not mx.cuda.is_available():
        raise RuntimeError("CUDA back-end not available")
    factory = mx.fast.metal_kernel if backend == "metal" else mx.fast.cuda_kernel
    return factory(
        name=name,
        input_names=INPUT_NAMES,
        output_names=OUTPUT_NAMES,
        source=source,
        header=kernel_header(backend),
        ensure_row_contiguous=True,
    )


@functools.cache
def _paged_decode_kernel(backend: str) -> KernelFn:
    return make_paged_decode_kernel(backend)


def template_args(
    queries: mx.array, k_pool: mx.array, *, num_simdgroups: int = NUM_SIMDGROUPS
) -> list[tuple[str, Any]]:
    """Template parameters, in the body's order: T, KV, D, BS, NSG."""
    return [
        ("T", queries.dtype),
        ("KV", k_pool.dtype),
        ("D", queries.shape[-1]),
        ("BS", k_pool.shape[2]),
        ("NSG", num_simdgroups),
    ]


def launch_dims(
    queries: mx.array, *, num_simdgroups: int = NUM_SIMDGROUPS
) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(grid, threadgroup) in threads: one threadgroup per (query head, sequence)."""
    B, num_q_heads = queries.shape[:2]
    threads = SIMD_WIDTH * num_simdgroups
    assert threads <= MAX_THREADS_PER_GROUP
    return (threads, num_q_heads, B), (threads, 1, 1)


def kernel_inputs(
    queries: mx.array,
    k_pool: mx.array,
    v_pool: mx.array,
    block_tables: mx.array,
    context_lens: Sequence[int] | mx.array,
    scale: float | mx.array,
) -> list[mx.array]:
    """The kernel's inputs in INPUT_NAMES order (lengths and scale as small arrays)."""
    if not isinstance(context_lens, mx.array):
        context_lens = mx.array([int(n) for n in context_lens], dtype=mx.int32)
    if not isinstance(scale, mx.array):
        scale = mx.array([float(scale)], dtype=mx.float32)
    # scale is a 1-element array, not a 0-d one: Metal binds 0-d inputs by
    # reference but CUDA by pointer, and one body must index it the same way.
    return [
        queries,
        k_pool,
        v_pool,
        block_tables.astype(mx.int32),
        context_lens.astype(mx.int32),
        scale.astype(mx.float32).reshape(1),
    ]


def _launch(
    kernel: KernelFn,
    inputs: list[mx.array],
    *,
    num_simdgroups: int = NUM_SIMDGROUPS,
    verbose: bool = False,
) -> mx.array:
    queries, k_pool = inputs[0], inputs[1]
    grid, threadgroup = launch_dims(queries, num_simdgroups=num_simdgroups)
    return kernel(
        inputs=inputs,
        template=template_args(queries, k_pool, num_simdgroups=num_simdgroups),
        grid=grid,
        threadgroup=threadgroup,
        output_shapes=[queries.shape],
        output_dtypes=[queries.dtype],
        verbose=verbose,
    )[0]


def paged_decode_attention(
    queries: mx.array,
    k_pool: mx.array,
    v_pool: mx.array,
    block_tables: mx.array,
    context_lens: Sequence[int],
    scale: float,
) -> mx.array:
    """Decode attention straight from the block pool (same contract as the reference).

    Args:
        queries: (B, Hq, 1, D); D a multiple of 32.
        k_pool, v_pool: (Hkv, num_blocks, block_size, D), Hq % Hkv == 0.
        block_tables: (B, max_blocks) int32 physical block ids.
        context_lens: B host ints, tokens per sequence including the new one.
        scale: softmax scale.

    Returns:
        (B, Hq, 1, D) in the queries' dtype.
    """
    backend = kernel_available()
    if backend is None:
        raise RuntimeError("no Metal or CUDA back-end for custom kernels")
    if not supports(queries, k_pool):
        raise ValueError(
            f"unsupported decode shapes: queries {queries.shape} {queries.dtype}, "
            f"k_pool {k_pool.shape} {k_pool.dtype}"
        )
    inputs = kernel_inputs(queries, k_pool, v_pool, block_tables, context_lens, scale)
    return _launch(_paged_decode_kernel(backend), inputs)

