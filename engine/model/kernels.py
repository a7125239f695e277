"""Custom GPU kernels: paged decode attention on Metal or CUDA, built once.

The kernel bodies live in `metal_kernels/`; the pure-MLX reference (CPU
fallback and test oracle) is `engine.model.paged_attention.paged_attention_ref`.
Prefill (L > 1) stays on the reference path.

One kernel serves plain and quantized pools: K and V are each either float rows
(bits 0) or `QuantizedBlocks` (4/8-bit `mx.quantize` rows, dequantized in
registers), chosen by template values; a plain side gets placeholder scales.

Switch and fallback: `KVCHAT_KERNELS=0` (or `EngineConfig(kernels=False)`)
keeps decode on the reference; a kernel that fails to build, launch or match
the reference on its first launch is dropped for the rest of the process
(`fall_back`), said once as a warning and kept in `kernel_fallback()`.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx

from engine.kvcache.kv_cache import QuantizedBlocks
from engine.model import memory
from metal_kernels import kernel_header, read_source

# Tiling: NUM_SIMDGROUPS simdgroups of SIMD_WIDTH lanes per (query head, sequence).
SIMD_WIDTH = 32
NUM_SIMDGROUPS = 8
MAX_THREADS_PER_GROUP = 1024
KERNEL_NAME = "paged_decode"
# The quantized sides' extras come last so the plain inputs keep their buffer
# slots. No input name may end another: MLX adds "<name>_shape" (and _strides,
# _ndim) parameters on a substring match, so with a "scales" input the text
# "k_scales_shape" would add its shape too. Hence the k_ / v_ prefixes.
INPUT_NAMES = [
    "queries",
    "k_pool",
    "v_pool",
    "block_tables",
    "context_lens",
    "scale",
    "k_scales",
    "k_biases",
    "v_scales",
    "v_biases",
]
OUTPUT_NAMES = ["out"]
SUPPORTED_DTYPES = (mx.float16, mx.bfloat16, mx.float32)
QUANT_BITS = (4, 8)
PLACEHOLDER_DTYPE = mx.float16  # a plain side's unused scales/biases input

KernelFn = Callable[..., list[mx.array]]
Pool = mx.array | QuantizedBlocks


ENV_SWITCH = "KVCHAT_KERNELS"
_OFF_VALUES = ("0", "false", "off", "no")
_log = logging.getLogger("kvchat.kernels")
_state_lock = threading.Lock()
_fallback: str | None = None  # why the kernels were dropped for this process
_validated: set[tuple] = set()  # kernel variants whose first launch matched the reference


def kernel_available() -> str | None:
    """Return "metal" or "cuda" when this MLX build can run custom kernels, else None."""
    backend = memory.backend()  # the one backend probe
    return backend if backend in ("metal", "cuda") else None


def kernels_enabled() -> bool:
    """False when the environment turns kernels off (`KVCHAT_KERNELS=0`, false, off, no)."""
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in _OFF_VALUES


def kernel_fallback() -> str | None:
    """Why the kernels were dropped for the rest of this process; None while they are not."""
    return _fallback


def active_backend() -> str | None:
    """The backend decode kernels run on now: available, switched on and not fallen back."""
    if _fallback is not None or not kernels_enabled():
        return None
    return kernel_available()


def fall_back(reason: str) -> None:
    """Drop the kernels for the rest of the process; warns (and logs) the first time only.

    A build or launch failure on a user's machine (another macOS, Metal or MLX
    version) must cost speed, not generation: the reference path takes over.
    """
    global _fallback
    with _state_lock:
        if _fallback is not None:
            return
        _fallback = reason
    message = f"kvchat: decode kernels off for this process, using the MLX reference: {reason}"
    _log.warning(message)
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def reset_fallback() -> None:
    """Forget a fallback and the validated variants (tests; a new MLX build in one process)."""
    global _fallback
    with _state_lock:
        _fallback = None
        _validated.clear()


def is_validated(key: tuple) -> bool:
    """Whether the variant `key` (see `variant_key`) already matched the reference once."""
    return key in _validated


def mark_validated(key: tuple) -> None:
    with _state_lock:
        _validated.add(key)


def _side_supported(pool: Pool, head_dim: int) -> bool:
    if isinstance(pool, QuantizedBlocks):
        quant = pool.quant
        return (
            pool.head_dim == head_dim
            and quant.bits in QUANT_BITS
            and head_dim % quant.group_size == 0
            and pool.data.dtype == mx.uint32
            and pool.scales.dtype in SUPPORTED_DTYPES
            and pool.biases.dtype == pool.scales.dtype
        )
    return pool.dtype in SUPPORTED_DTYPES


def supports(queries: mx.array, k_pool: Pool, v_pool: Pool | None = None) -> bool:
    """Whether `paged_decode_attention` handles these shapes and dtypes.

    Each pool may be a float array or `QuantizedBlocks` (4/8-bit, its group
    dividing the head dim); `v_pool`, when given, is checked the same way.
    """
    _, num_q_heads, L, D = queries.shape
    num_kv_heads = k_pool.shape[0]
    pools = [k_pool] if v_pool is None else [k_pool, v_pool]
    return (
        L == 1
        and D % SIMD_WIDTH == 0
        and num_q_heads % num_kv_heads == 0
        and queries.dtype in SUPPORTED_DTYPES
        and all(_side_supported(p, D) for p in pools)
        and all(p.shape[:3] == k_pool.shape[:3] for p in pools)
    )


def make_paged_decode_kernel(
    backend: str,
    *,
    body: str | None = None,
    header: str | None = None,
    name: str = KERNEL_NAME,
):
    """Construct (not compile) the kernel; `body` / `header` override the sources (test mutants)."""
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
        header=kernel_header(backend) if header is None else header,
        ensure_row_contiguous=True,
    )


@functools.cache
def _paged_decode_kernel(backend: str) -> KernelFn:
    return make_paged_decode_kernel(backend)


def _quant_template(pool: Pool) -> tuple[int, int]:
    """(bits, group size) of one side; (0, 0) for plain rows."""
    if isinstance(pool, QuantizedBlocks):
        return pool.quant.bits, pool.quant.group_size
    return 0, 0


def template_args(
    queries: mx.array, k_pool: Pool, v_pool: Pool, *, num_simdgroups: int = NUM_SIMDGROUPS
) -> list[tuple[str, Any]]:
    """Template parameters, in the body's order: T, D, BS, NSG, KB, KG, VB, VG."""
    k_bits, k_group = _quant_template(k_pool)
    v_bits, v_group = _quant_template(v_pool)
    return [
        ("T", queries.dtype),
        ("D", queries.shape[-1]),
        ("BS", k_pool.shape[2]),
        ("NSG", num_simdgroups),
        ("KB", k_bits),
        ("KG", k_group),
        ("VB", v_bits),
        ("VG", v_group),
    ]


def launch_dims(
    queries: mx.array, *, num_simdgroups: int = NUM_SIMDGROUPS
) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(grid, threadgroup) in threads: one threadgroup per (query head, sequence)."""
    B, num_q_heads = queries.shape[:2]
    threads = SIMD_WIDTH * num_simdgroups
    assert threads <= MAX_THREADS_PER_GROUP
    return (threads, num_q_heads, B), (threads, 1, 1)


def _side_inputs(pool: Pool) -> tuple[mx.array, mx.array, mx.array]:
    """(rows, scales, biases) of one side; a plain side's scales are a placeholder."""
    if isinstance(pool, QuantizedBlocks):
        return pool.data, pool.scales, pool.biases
    placeholder = mx.zeros((1,), dtype=PLACEHOLDER_DTYPE)
    return pool, placeholder, placeholder


def variant_key(
    queries: mx.array, k_pool: Pool, v_pool: Pool, block_tables: mx.array, kind: str = KERNEL_NAME
) -> tuple:
    """What selects a distinct compiled kernel: kind, template values, input dtypes and
    which inputs MLX binds as constant memory (fewer than 8 elements)."""
    sides = [_side_inputs(p) for p in (k_pool, v_pool)]
    arrays = [queries, sides[0][0], sides[1][0], block_tables, *sides[0][1:], *sides[1][1:]]
    small = (block_tables.shape[0] < 8, block_tables.size < 8)  # lengths; the table
    return (
        kind,
        tuple(template_args(queries, k_pool, v_pool)),
        queries.shape[1] // k_pool.shape[0],  # the GQA ratio: the two-pass QPG
        tuple((a.dtype, a.size < 8) for a in arrays),
        small,
    )


def kernel_inputs(
    queries: mx.array,
    k_pool: Pool,
    v_pool: Pool,
    block_tables: mx.array,
    context_lens: Sequence[int] | mx.array,
    scale: float | mx.array,
) -> list[mx.array]:
    """The kernel's inputs in INPUT_NAMES order (lengths and scale as small arrays)."""
    if not isinstance(context_lens, mx.array):
        context_lens = mx.array([int(n) for n in context_lens], dtype=mx.int32)
    if not isinstance(scale, mx.array):
        scale = mx.array([float(scale)], dtype=mx.float32)
    k_rows, k_scales, k_biases = _side_inputs(k_pool)
    v_rows, v_scales, v_biases = _side_inputs(v_pool)
    # scale is a 1-element array, not a 0-d one: Metal binds 0-d inputs by
    # reference but CUDA by pointer, and one body must index it the same way.
    return [
        queries,
        k_rows,
        v_rows,
        block_tables.astype(mx.int32),
        context_lens.astype(mx.int32),
        scale.astype(mx.float32).reshape(1),
        k_scales,
        k_biases,
        v_scales,
        v_biases,
    ]


def _launch(
    kernel: KernelFn,
    inputs: list[mx.array],
    template: list[tuple[str, Any]],
    *,
    num_simdgroups: int = NUM_SIMDGROUPS,
    verbose: bool = False,
) -> mx.array:
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
    scale: float,
) -> mx.array:
    """Decode attention straight from the block pool (same contract as the reference).

    Args:
        queries: (B, Hq, 1, D); D a multiple of 32.
        k_pool, v_pool: (Hkv, num_blocks, block_size, D), Hq % Hkv == 0; each a
            float array or `QuantizedBlocks` (4/8-bit, dequantized in registers).
        block_tables: (B, max_blocks) int32 physical block ids.
        context_lens: B host ints, tokens per sequence including the new one.
        scale: softmax scale.

    Returns:
        (B, Hq, 1, D) in the queries' dtype.
    """
    backend = kernel_available()
    if backend is None:
        raise RuntimeError("no Metal or CUDA back-end for custom kernels")
    if not supports(queries, k_pool, v_pool):
        raise ValueError(
            f"unsupported decode shapes: queries {queries.shape} {queries.dtype}, "
            f"k_pool {k_pool.shape} {k_pool.dtype}, v_pool {v_pool.shape} {v_pool.dtype}"
        )
    inputs = kernel_inputs(queries, k_pool, v_pool, block_tables, context_lens, scale)
    template = template_args(queries, k_pool, v_pool)
    return _launch(_paged_decode_kernel(backend), inputs, template)


# The two-pass kernels live in their own module (imported only through this one, which it
# builds on); re-exported so dispatch, benchmarks and tests use one namespace.
from engine.model.kernels_two_pass import (  # noqa: E402, F401
    MAX_HEADS_PER_GROUP,
    PARTITION_TOKENS,
    REDUCE_INPUT_NAMES,
    REDUCE_NAME,
    SPLIT_NAME,
    SPLIT_OUTPUT_NAMES,
    _two_pass_kernels,
    heads_per_group,
    make_two_pass_kernels,
    num_partitions,
    paged_decode_two_pass,
    reduce_launch,
    split_launch,
    split_template,
)
