"""The two-pass (split-K) paged decode kernels: long contexts on Metal or CUDA.

Pass 1 (paged_decode_split.metal): one threadgroup per (partition of PARTITION_TOKENS
tokens, group of query heads sharing a KV head, sequence); pass 2
(paged_decode_reduce.metal) merges the partitions. For long contexts: the one-pass
kernel (`one_pass`) has only Hq x B threadgroups, each walking all tokens.
"""

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

SPLIT_NAME = "paged_decode_split"
REDUCE_NAME = "paged_decode_reduce"
SPLIT_OUTPUT_NAMES = ["part_out", "part_max", "part_sum"]
REDUCE_INPUT_NAMES = ["part_out", "part_max", "part_sum", "context_lens", "attn_window",
                      "attn_sinks"]
PARTITION_TOKENS = 512
MAX_HEADS_PER_GROUP = 8  # q/o registers per lane grow with it: 2 x 8 x D / 32 floats


def heads_per_group(num_q_heads: int, num_kv_heads: int, limit: int = MAX_HEADS_PER_GROUP) -> int:
    """Query heads one pass-1 threadgroup serves: the largest divisor of the GQA ratio <= limit."""
    ratio = num_q_heads // num_kv_heads
    return max(d for d in range(1, min(ratio, limit) + 1) if ratio % d == 0)


def num_partitions(context_lens: Sequence[int], partition_tokens: int = PARTITION_TOKENS) -> int:
    """Partitions of the longest sequence (the grid's x extent in threadgroups)."""
    return -(-max(int(n) for n in context_lens) // partition_tokens)


def make_two_pass_kernels(
    backend: str,
    *,
    split_body: str | None = None,
    reduce_body: str | None = None,
    header: str | None = None,
    names: tuple[str, str] = (SPLIT_NAME, REDUCE_NAME),
):
    """Construct (not compile) the (split, reduce) kernels; overrides are for test mutants."""
    factory = kernel_factory(backend)
    head = kernel_header(backend) if header is None else header
    split = factory(
        name=names[0], input_names=INPUT_NAMES, output_names=SPLIT_OUTPUT_NAMES,
        source=read_source("paged_decode_split.metal") if split_body is None else split_body,
        header=head, ensure_row_contiguous=True,
    )
    reduce = factory(
        name=names[1], input_names=REDUCE_INPUT_NAMES, output_names=OUTPUT_NAMES,
        source=read_source("paged_decode_reduce.metal") if reduce_body is None else reduce_body,
        header=head, ensure_row_contiguous=True,
    )
    return split, reduce


@functools.cache
def _two_pass_kernels(backend: str) -> tuple[KernelFn, KernelFn]:
    return make_two_pass_kernels(backend)


def split_template(
    queries: mx.array, k_pool: Pool, v_pool: Pool, *, num_simdgroups: int = NUM_SIMDGROUPS,
    partition_tokens: int = PARTITION_TOKENS, qpg: int | None = None,
) -> list[tuple[str, Any]]:
    """Pass 1's template: the one-pass kernel's, then QPG and PS."""
    qpg = qpg or heads_per_group(queries.shape[1], k_pool.shape[0])
    base = template_args(queries, k_pool, v_pool, num_simdgroups=num_simdgroups)
    return [*base, ("QPG", qpg), ("PS", partition_tokens)]


def split_launch(
    queries: mx.array, parts: int, *, num_simdgroups: int = NUM_SIMDGROUPS, qpg: int
) -> dict[str, Any]:
    """Pass 1's grid, threadgroup and outputs (partials laid out (NP, B, Hq[, D]))."""
    B, num_q_heads, _, D = queries.shape
    threads = SIMD_WIDTH * num_simdgroups
    assert threads <= MAX_THREADS_PER_GROUP and num_q_heads % qpg == 0
    return {
        "grid": (threads * parts, num_q_heads // qpg, B),
        "threadgroup": (threads, 1, 1),
        "output_shapes": [(parts, B, num_q_heads, D), (parts, B, num_q_heads),
                          (parts, B, num_q_heads)],
        "output_dtypes": [mx.float32] * 3,
    }


def reduce_launch(queries: mx.array, partition_tokens: int = PARTITION_TOKENS) -> dict[str, Any]:
    """Pass 2's template, grid, threadgroup and output: one thread per output element."""
    B, num_q_heads, _, D = queries.shape
    return {
        "template": [("T", queries.dtype), ("D", D), ("PS", partition_tokens)],
        "grid": (D, num_q_heads, B),
        "threadgroup": (D, 1, 1),
        "output_shapes": [queries.shape],
        "output_dtypes": [queries.dtype],
    }


def paged_decode_two_pass(
    queries: mx.array,
    k_pool: Pool,
    v_pool: Pool,
    block_tables: mx.array,
    context_lens: Sequence[int],
    scale: float | AttentionSpec,
    *,
    partition_tokens: int = PARTITION_TOKENS,
) -> mx.array:
    """`one_pass.paged_decode_attention`'s contract, computed in two passes (split-K).

    Pass 1 reads each K/V row once for all query heads of its KV head (up to
    MAX_HEADS_PER_GROUP) and writes fp32 partials per partition of
    `partition_tokens` tokens; pass 2 merges them and rounds once.
    """
    backend = check_launchable(queries, k_pool, v_pool)
    split, reduce = _two_pass_kernels(backend)
    inputs = kernel_inputs(queries, k_pool, v_pool, block_tables, context_lens, scale)
    qpg = heads_per_group(queries.shape[1], k_pool.shape[0])
    parts = num_partitions(context_lens, partition_tokens)
    partials = split(
        inputs=inputs,
        template=split_template(queries, k_pool, v_pool, partition_tokens=partition_tokens,
                                qpg=qpg),
        **split_launch(queries, parts, qpg=qpg),
    )
    return reduce(inputs=[*partials, *reduce_extras(inputs)],
                  **reduce_launch(queries, partition_tokens))[0]


def reduce_extras(inputs: list[mx.array]) -> list[mx.array]:
    """Pass 2's inputs after the partials, taken from pass 1's (`abi.kernel_inputs`)."""
    names = dict(zip(INPUT_NAMES, inputs, strict=True))
    return [names["context_lens"], names["attn_window"], names["attn_sinks"]]
