"""Attention over a residual-format pool on kvchat's C++ CPU extension: what
`attention/residual.py` computes, decode and prefill in one op (csrc/paged_residual*.cpp).

A full block's keys are stored per channel (`kvcache.channel_quant`), so the op scores a
block as ``(q * scales) @ codes + q @ biases``: one multiply-add of 16 tokens' codes per
channel, no dequantized key row. Values are per-token rows dequantized as read. A block
still residual is read exact; rotated sides are met inside the op (queries rotated for the
quantized keys, the exact rows' weighted value sum rotated into the quantized rows' space,
the output rotated back).

A prefill chunk runs on the extension's flash prefill kernel over the sequence's blocks
laid out as float rows inside the op (csrc/paged_residual_prefill.cpp): the quantized
blocks before the chunk's last dequantized from their codes, and the chunk's blocks exact,
both kept in the stored (rotated) spaces. Each block of the chunk becomes one row of a
batch: its queries see the blocks before it quantized and itself exact (causal), which is
the rule, so a query's result depends on its position only.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from engine.kvcache import rotation
from engine.kvcache.channel_quant import ChannelBlocks
from engine.kvcache.quantized_blocks import QuantizedBlocks
from engine.kvcache.residual_blocks import ResidualBlocks
from engine.model.attention import cpu
from engine.model.attention.spec import AttentionSpec, PagedCall
from engine.model.cpu_ext import build

HEAD_DIMS = (64, 128)  # what the residual decode op is built for (csrc kResidualHeadDims)


def supports(call: PagedCall) -> bool:
    """Whether this module takes the call: over a residual pool whose keys are per channel
    (the -kivi formats), 4/8 bits, head dim 64 or 128, blocks a multiple of 16; sliding
    windows and sinks as the layer has them."""
    k, v = call.k_pool, call.v_pool
    if not (isinstance(k, ResidualBlocks) and isinstance(v, ResidualBlocks)):
        return False
    kq, vq = k.quantized, v.quantized
    H, _, bs, D = k.shape
    floats = cpu.FLOAT_DTYPES
    return (isinstance(kq, ChannelBlocks) and isinstance(vq, QuantizedBlocks)
            and kq.bits in cpu.QUANT_BITS and vq.quant.bits in cpu.QUANT_BITS
            and vq.quant.group_size % 32 == 0 and D % vq.quant.group_size == 0
            and D in HEAD_DIMS and bs % 16 == 0
            and call.queries.shape[1] % H == 0
            and call.queries.dtype in floats and k.residual.dtype in floats
            and kq.scales.dtype in floats and vq.scales.dtype in floats)


def launch(queries: mx.array, k_pool: ResidualBlocks, v_pool: ResidualBlocks,
           block_tables: mx.array, context_lens: Sequence[int] | mx.array,
           scale: float | AttentionSpec, **_) -> mx.array:
    """Attention of each sequence's L newest queries (B, Hq, L, D) over a residual pool by
    its rule, one op: decode (L = 1) or a causal prefill chunk; (B, Hq, L, D)."""
    spec = AttentionSpec.of(scale)
    kq, vq = k_pool.quantized, v_pool.quantized
    rotated = k_pool.rotated or v_pool.rotated
    return build.require().paged_residual(
        queries, kq.data, kq.scales, kq.biases, vq.data, vq.scales, vq.biases,
        k_pool.residual, v_pool.residual, k_pool.res_map.astype(mx.int32),
        block_tables.astype(mx.int32), cpu.lens_array(context_lens),
        scale=float(spec.scale), k_bits=kq.bits, v_bits=vq.quant.bits,
        v_group=vq.quant.group_size, sinks=spec.sinks,
        rotation=rotation.signs(queries.shape[-1]) if rotated else None,
        rotate_k=k_pool.rotated, rotate_v=v_pool.rotated, window=spec.window or 0)


def variant_key(call: PagedCall) -> tuple:
    """What the first-launch check tells apart: the kind, dtypes, GQA, dims, bits, rotation."""
    k, v = call.k_pool, call.v_pool
    return ("residual", call.kind != "decode", call.queries.dtype, call.gqa_ratio,
            call.queries.shape[3], k.shape[2], k.quantized.bits, v.quantized.quant.bits,
            v.quantized.quant.group_size, k.residual.dtype, k.rotated, v.rotated)
