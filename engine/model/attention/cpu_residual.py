"""Decode attention over a residual-format pool on kvchat's C++ CPU extension
(csrc/paged_residual*.cpp): what `attention/residual.py` computes for one query per
sequence, in one op.

A full block's keys are stored per channel (`kvcache.channel_quant`), so the op scores a
block as ``(q * scales) @ codes + q @ biases``: one multiply-add of 16 tokens' codes per
channel, no dequantized key row. Values are per-token rows dequantized as read. A block
still residual is read exact; rotated sides are met inside the op (queries rotated for the
quantized keys, exact value rows rotated into the quantized rows' space and the output
rotated back). Prefill chunks stay on the reference.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from engine.kvcache import rotation
from engine.kvcache.channel_quant import ChannelBlocks
from engine.kvcache.kv_cache import QuantizedBlocks
from engine.kvcache.residual_blocks import ResidualBlocks
from engine.model.attention.spec import AttentionSpec, PagedCall
from engine.model.cpu_ext import build

BITS = (4, 8)
FLOAT_DTYPES = (mx.float32, mx.float16, mx.bfloat16)


def supports(call: PagedCall) -> bool:
    """Whether `paged_residual_decode` takes this call: a decode over a residual pool whose
    keys are per channel (the -kivi formats), 4/8 bits, head dim and block size multiples
    of 16, no sliding window (the residual formats refuse windowed layers anyway)."""
    k, v = call.k_pool, call.v_pool
    if call.kind != "decode" or not (isinstance(k, ResidualBlocks)
                                     and isinstance(v, ResidualBlocks)):
        return False
    kq, vq = k.quantized, v.quantized
    H, _, bs, D = k.shape
    return (isinstance(kq, ChannelBlocks) and isinstance(vq, QuantizedBlocks)
            and kq.bits in BITS and vq.quant.bits in BITS and vq.quant.group_size % 32 == 0
            and D % vq.quant.group_size == 0 and D % 16 == 0 and bs % 16 == 0
            and call.queries.shape[1] % H == 0 and call.spec.window is None
            and call.queries.dtype in FLOAT_DTYPES and k.residual.dtype in FLOAT_DTYPES
            and kq.scales.dtype in FLOAT_DTYPES and vq.scales.dtype in FLOAT_DTYPES)


def paged_decode(queries: mx.array, k_pool: ResidualBlocks, v_pool: ResidualBlocks,
                 block_tables: mx.array, context_lens: Sequence[int] | mx.array,
                 scale: float | AttentionSpec, **_) -> mx.array:
    """Decode attention (queries (B, Hq, 1, D)) over a residual pool by its rule: each
    block exact where the residual map holds it, else quantized; (B, Hq, 1, D)."""
    spec = AttentionSpec.of(scale)
    if not isinstance(context_lens, mx.array):
        context_lens = mx.array([int(n) for n in context_lens], dtype=mx.int32)
    kq, vq = k_pool.quantized, v_pool.quantized
    rotated = k_pool.rotated or v_pool.rotated
    return build.require().paged_residual_decode(
        queries, kq.data, kq.scales, kq.biases, vq.data, vq.scales, vq.biases,
        k_pool.residual, v_pool.residual, k_pool.res_map.astype(mx.int32),
        block_tables.astype(mx.int32), context_lens.astype(mx.int32),
        scale=float(spec.scale), k_bits=kq.bits, v_bits=vq.quant.bits,
        v_group=vq.quant.group_size, sinks=spec.sinks,
        rotation=rotation.signs(queries.shape[-1]) if rotated else None,
        rotate_k=k_pool.rotated, rotate_v=v_pool.rotated)


def variant_key(call: PagedCall) -> tuple:
    """What the first-launch check tells apart: dtypes, GQA, dims, bits, rotation."""
    k, v = call.k_pool, call.v_pool
    return ("residual", call.queries.dtype, call.gqa_ratio, call.queries.shape[3],
            k.shape[2], k.quantized.bits, v.quantized.quant.bits, v.quantized.quant.group_size,
            k.residual.dtype, k.rotated, v.rotated)
