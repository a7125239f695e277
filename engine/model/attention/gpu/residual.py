"""The GPU decode kernel over a residual-format pool (metal_kernels/paged_residual.metal):
keys per channel within a block and per-token values dequantized in registers, each row's
own block read exact from the residual rows, one threadgroup per (query head, sequence).

A rotated pool stores its quantized rows times R (`kvcache.rotation`); the kernel works
in that space: the queries, and the residual rows it reads exact, are rotated before the
launch (the residual rows are the newest block of each sequence: few), and the output is
rotated back after it, all in float32, so only the kernel's own float32 accumulation
differs from the exact rule.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from engine.kvcache import rotation
from engine.kvcache.channel_quant import ChannelBlocks
from engine.kvcache.quantized_blocks import QuantizedBlocks
from engine.kvcache.residual_blocks import ResidualBlocks
from engine.model import backend
from engine.model.attention.gpu import abi
from engine.model.attention.gpu.one_pass import launch_kernel
from engine.model.attention.spec import AttentionSpec, PagedCall
from metal_kernels import kernel_header, read_source

KERNEL_NAME = "paged_residual"
# No name may end another (MLX adds "<name>_shape" on a substring match).
INPUT_NAMES = ["queries", "k_codes", "k_scales", "k_biases", "v_pool", "v_scales", "v_biases",
               "res_k", "res_v", "res_map", "block_tables", "context_lens", "scale",
               "attn_window", "attn_sinks"]
OUTPUT_NAMES = ["out"]


def supports(call: PagedCall) -> bool:
    """Whether the kernel reads this call: a decode over a pool whose keys are per channel."""
    k, v = call.k_pool, call.v_pool
    if not (isinstance(k, ResidualBlocks) and isinstance(v, ResidualBlocks)):
        return False
    kq, vq = k.quantized, v.quantized
    H, _, bs, D = k.shape
    return (call.kind == "decode" and isinstance(kq, ChannelBlocks)
            and isinstance(vq, QuantizedBlocks) and kq.bits in abi.QUANT_BITS
            and vq.quant.bits in abi.QUANT_BITS and D % abi.SIMD_WIDTH == 0
            and D % vq.quant.group_size == 0 and bs % 2 == 0
            and call.queries.shape[1] % H == 0
            and call.queries.dtype in abi.SUPPORTED_DTYPES
            and k.residual.dtype in abi.SUPPORTED_DTYPES
            and kq.scales.dtype in abi.SUPPORTED_DTYPES
            and vq.scales.dtype in abi.SUPPORTED_DTYPES)


def template_args(dtype: mx.Dtype, k_pool: ResidualBlocks, v_pool: ResidualBlocks, *,
                  num_simdgroups: int = abi.NUM_SIMDGROUPS) -> list[tuple[str, Any]]:
    """Template parameters, in the body's order: T (the queries' dtype as launched), D, BS,
    NSG, KB, VB, VG."""
    vq = v_pool.quantized.quant
    return [("T", dtype), ("D", k_pool.shape[3]), ("BS", k_pool.shape[2]),
            ("NSG", num_simdgroups), ("KB", k_pool.quantized.bits), ("VB", vq.bits),
            ("VG", vq.group_size)]


def _spaces(queries: mx.array, k_pool: ResidualBlocks, v_pool: ResidualBlocks):
    """(queries, residual K rows, residual V rows), each in its quantized side's space, the
    rows (Hkv, num_residual * block_size, D)."""
    def rows(pool: ResidualBlocks) -> mx.array:
        res = pool.residual
        res = res.reshape(res.shape[0], -1, res.shape[-1])
        return rotation.rotate(res.astype(mx.float32)) if pool.rotated else res
    q = rotation.rotate(queries.astype(mx.float32)) if k_pool.rotated else queries
    return q, rows(k_pool), rows(v_pool)


def kernel_inputs(queries: mx.array, k_pool: ResidualBlocks, v_pool: ResidualBlocks,
                  block_tables: mx.array, context_lens: Sequence[int] | mx.array,
                  scale: float | AttentionSpec) -> list[mx.array]:
    """The kernel's inputs in INPUT_NAMES order (the queries and residual rows already in
    the quantized sides' spaces)."""
    q, res_k, res_v = _spaces(queries, k_pool, v_pool)
    lens, scale, window, sinks = abi.small_inputs(context_lens, scale)
    kq, vq = k_pool.quantized, v_pool.quantized
    return [q, kq.data, kq.scales, kq.biases, vq.data, vq.scales, vq.biases, res_k, res_v,
            k_pool.res_map.astype(mx.int32), block_tables.astype(mx.int32), lens, scale,
            window, sinks]


def make_kernel(backend: str, *, body: str | None = None):
    """Construct (not compile) the kernel; ``body`` overrides the source (test mutants)."""
    return abi.kernel_factory(backend)(
        name=KERNEL_NAME, input_names=INPUT_NAMES, output_names=OUTPUT_NAMES,
        source=read_source("paged_residual.metal") if body is None else body,
        header=kernel_header(backend), ensure_row_contiguous=True)


@functools.cache
def _kernel(backend: str):
    return make_kernel(backend)


def launch(queries: mx.array, k_pool: ResidualBlocks, v_pool: ResidualBlocks,
           block_tables: mx.array, context_lens: Sequence[int] | mx.array,
           scale: float | AttentionSpec, **_) -> mx.array:
    """Decode attention over a residual pool by its rule, (B, Hq, 1, D) in the queries'
    dtype; NaN rows for a sequence whose table names a block outside the pool."""
    name = backend.kernel_backend()  # read at each call: tests fake a GPU
    if name is None:
        raise RuntimeError("no Metal or CUDA back-end for custom kernels")
    call = PagedCall(queries, k_pool, v_pool, block_tables, tuple(map(int, context_lens)),
                     AttentionSpec.of(scale))
    if not supports(call):
        raise ValueError("paged_residual: not a decode over a residual pool with keys per "
                         f"channel the kernel reads (queries {queries.shape} {queries.dtype})")
    inputs = kernel_inputs(queries, k_pool, v_pool, block_tables, context_lens, scale)
    out = launch_kernel(_kernel(name), inputs, template_args(inputs[0].dtype, k_pool, v_pool))
    if v_pool.rotated:
        out = rotation.unrotate(out.astype(mx.float32))
    return out.astype(queries.dtype)


def variant_key(call: PagedCall) -> tuple:
    """What selects a distinct compiled kernel: template values and input dtypes."""
    k, v = call.k_pool, call.v_pool
    dtype = mx.float32 if k.rotated else call.queries.dtype  # rotated queries: float32
    arrays = [k.quantized.data, k.quantized.scales, v.quantized.data, v.quantized.scales,
              k.residual]
    # inputs of fewer than 8 elements are bound as constant memory: another kernel
    small = (k.res_map.size < 8, call.block_tables.size < 8, call.batch < 8,
             call.queries.shape[1] < 8)
    return ("gpu_residual", tuple(template_args(dtype, k, v)), k.rotated, v.rotated,
            tuple(a.dtype for a in arrays), small)
