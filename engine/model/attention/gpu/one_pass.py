"""The one-pass paged decode kernel: one threadgroup per (query head, sequence), each
walking the sequence's blocks with an online softmax (metal_kernels/paged_attention.metal)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from engine.model.attention.gpu.abi import (
    INPUT_NAMES,
    MAX_THREADS_PER_GROUP,
    NUM_SIMDGROUPS,
    OUTPUT_NAMES,
    SIMD_WIDTH,
    KernelFn,
    check_launchable,
    kernel_factory,
    kernel_inputs,
    template_args,
)
from engine.model.attention.spec import AttentionSpec, Pool
from metal_kernels import kernel_header, read_source

KERNEL_NAME = "paged_decode"


def make_paged_decode_kernel(backend: str, *, body: str | None = None,
                             header: str | None = None, name: str = KERNEL_NAME):
    """Construct (not compile) the kernel; `body` / `header` override the sources (test mutants)."""
    source = read_source("paged_attention.metal") if body is None else body
    return kernel_factory(backend)(
        name=name,
        input_names=INPUT_NAMES,
        output_names=OUTPUT_NAMES,
        source=source,
        header=kernel_header(backend) if header is None else header,
        ensure_row_contiguous=True,
    )


@functools.cache
def _paged_decode_kernel(backend: str) -> KernelFn:
    return make_paged_decode_kernel(backend)


def launch_dims(
    queries: mx.array, *, num_simdgroups: int = NUM_SIMDGROUPS
) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(grid, threadgroup) in threads: one threadgroup per (query head, sequence)."""
    B, num_q_heads = queries.shape[:2]
    threads = SIMD_WIDTH * num_simdgroups
    assert threads <= MAX_THREADS_PER_GROUP
    return (threads, num_q_heads, B), (threads, 1, 1)


def launch_kernel(kernel: KernelFn, inputs: list[mx.array], template: list[tuple[str, Any]],
                  *, num_simdgroups: int = NUM_SIMDGROUPS, verbose: bool = False) -> mx.array:
    """One launch of a one-threadgroup-per-(query head, sequence) kernel whose first input
    is the queries and whose one output has their shape and dtype."""
    queries = inputs[0]
    grid, threadgroup = launch_dims(queries, num_simdgroups=num_simdgroups)
    return kernel(
        inputs=inputs,
        template=template,
        grid=grid,
        threadgroup=threadgroup,
        output_shapes=[queries.shape],
        output_dtypes=[queries.dtype],
        verbose=verbose,
    )[0]


def paged_decode_attention(
    queries: mx.array,
    k_pool: Pool,
    v_pool: Pool,
    block_tables: mx.array,
    context_lens: Sequence[int],
    scale: float | AttentionSpec,
) -> mx.array:
    """Decode attention straight from the block pool (the contract of
    `engine.model.attention`, L == 1), sliding windows and sinks included.

    Args:
        queries: (B, Hq, 1, D); D a multiple of 32.
        k_pool, v_pool: (Hkv, num_blocks, block_size, D), Hq % Hkv == 0; each a
            float array or `QuantizedBlocks` (4/8-bit, dequantized in registers).
        block_tables: (B, max_blocks) int32 physical block ids.
        context_lens: B host ints, tokens per sequence including the new one.
        scale: softmax scale, or the layer's `AttentionSpec` (window, sinks).

    Returns:
        (B, Hq, 1, D) in the queries' dtype.
    """
    backend = check_launchable(queries, k_pool, v_pool)
    inputs = kernel_inputs(queries, k_pool, v_pool, block_tables, context_lens, scale)
    template = template_args(queries, k_pool, v_pool)
    return launch_kernel(_paged_decode_kernel(backend), inputs, template)
