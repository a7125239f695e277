"""What the paged decode kernels share: input names and order, supported shapes and
dtypes, template values, the variant key, and the kernel factory of each backend."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx

from engine.kvcache.quantized_blocks import QuantizedBlocks
from engine.model import backend
from engine.model.attention.spec import AttentionSpec, Pool

# Tiling: NUM_SIMDGROUPS simdgroups of SIMD_WIDTH lanes per (query head, sequence).
SIMD_WIDTH = 32
NUM_SIMDGROUPS = 8
MAX_THREADS_PER_GROUP = 1024
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
    "attn_window",
    "attn_sinks",
]
OUTPUT_NAMES = ["out"]
SUPPORTED_DTYPES = (mx.float16, mx.bfloat16, mx.float32)
QUANT_BITS = (4, 8)
PLACEHOLDER_DTYPE = mx.float16  # a plain side's unused scales/biases input
# A layer without sinks passes one sink of this logit: it adds exp(-huge) = 0 to every
# softmax and never raises a maximum, so one body serves both (common.h's PA_FINITE_MIN).
NO_SINK = -3.4028234663852886e38

KernelFn = Callable[..., list[mx.array]]


def kernel_factory(backend: str):
    """`mx.fast.metal_kernel` or `mx.fast.cuda_kernel`; raises where it cannot build."""
    if backend not in ("metal", "cuda"):
        raise ValueError(f"unknown kernel backend {backend!r}")
    # Construction raises on builds without the CUDA back-end: check first.
    if backend == "cuda" and not mx.cuda.is_available():
        raise RuntimeError("CUDA back-end not available")
    return mx.fast.metal_kernel if backend == "metal" else mx.fast.cuda_kernel


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
    return isinstance(pool, mx.array) and pool.dtype in SUPPORTED_DTYPES


def supports(queries: mx.array, k_pool: Pool, v_pool: Pool | None = None) -> bool:
    """Whether the decode kernels handle these shapes and dtypes.

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


def _side_inputs(pool: Pool) -> tuple[mx.array, mx.array, mx.array]:
    """(rows, scales, biases) of one side; a plain side's scales are a placeholder."""
    if isinstance(pool, QuantizedBlocks):
        return pool.data, pool.scales, pool.biases
    placeholder = mx.zeros((1,), dtype=PLACEHOLDER_DTYPE)
    return pool, placeholder, placeholder


def variant_key(
    queries: mx.array, k_pool: Pool, v_pool: Pool, block_tables: mx.array, kind: str
) -> tuple:
    """What selects a distinct compiled kernel: kind, template values, input dtypes and
    which inputs MLX binds as constant memory (fewer than 8 elements)."""
    sides = [_side_inputs(p) for p in (k_pool, v_pool)]
    arrays = [queries, sides[0][0], sides[1][0], block_tables, *sides[0][1:], *sides[1][1:]]
    # attn_sinks is one placeholder or Hq values: constant memory below 8 of them
    small = (block_tables.shape[0] < 8, block_tables.size < 8)  # lengths; the table
    return (
        kind,
        tuple(template_args(queries, k_pool, v_pool)),
        queries.shape[1] // k_pool.shape[0],  # the GQA ratio: the two-pass QPG
        tuple((a.dtype, a.size < 8) for a in arrays),
        small,
        queries.shape[1] < 8,
    )


def small_inputs(context_lens: Sequence[int] | mx.array, scale: float | AttentionSpec | mx.array,
                 ) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """(context_lens, scale, attn_window, attn_sinks) as the kernels take them: int32
    lengths, a 1-element float32 scale, the window (0 = none) and one sink logit per query
    head (one `NO_SINK` placeholder without); an `AttentionSpec` brings window and sinks."""
    if not isinstance(context_lens, mx.array):
        context_lens = mx.array([int(n) for n in context_lens], dtype=mx.int32)
    window, sinks = 0, None
    if isinstance(scale, AttentionSpec):
        window, sinks, scale = scale.window or 0, scale.sinks, scale.scale
    if not isinstance(scale, mx.array):
        scale = mx.array([float(scale)], dtype=mx.float32)
    sinks = (mx.array([NO_SINK], dtype=mx.float32) if sinks is None
             else sinks.astype(mx.float32).reshape(-1))
    # scale is a 1-element array, not a 0-d one: Metal binds 0-d inputs by
    # reference but CUDA by pointer, and one body must index it the same way.
    return (context_lens.astype(mx.int32), scale.astype(mx.float32).reshape(1),
            mx.array([int(window)], dtype=mx.int32), sinks)


def kernel_inputs(
    queries: mx.array,
    k_pool: Pool,
    v_pool: Pool,
    block_tables: mx.array,
    context_lens: Sequence[int] | mx.array,
    scale: float | AttentionSpec | mx.array,
) -> list[mx.array]:
    """The kernel's inputs in INPUT_NAMES order (lengths and scale as small arrays,
    `small_inputs`)."""
    lens, scale, window, sinks = small_inputs(context_lens, scale)
    k_rows, k_scales, k_biases = _side_inputs(k_pool)
    v_rows, v_scales, v_biases = _side_inputs(v_pool)
    return [queries, k_rows, v_rows, block_tables.astype(mx.int32), lens, scale,
            k_scales, k_biases, v_scales, v_biases, window, sinks]


def check_launchable(queries: mx.array, k_pool: Pool, v_pool: Pool) -> str:
    """The backend to launch on; raises where no kernel applies (the entry points' guard)."""
    name = backend.kernel_backend()  # read at each call: tests fake a GPU
    if name is None:
        raise RuntimeError("no Metal or CUDA back-end for custom kernels")
    if not supports(queries, k_pool, v_pool):
        raise ValueError(
            f"unsupported decode shapes: queries {queries.shape} {queries.dtype}, "
            f"k_pool {k_pool.shape} {k_pool.dtype}, v_pool {v_pool.shape} {v_pool.dtype}")
    return name
