"""Attention over a residual-format pool on kvchat's C++ CPU extension: what
`attention/residual.py` computes, decode in one op (csrc/paged_residual*.cpp).

A full block's keys are stored per channel (`kvcache.channel_quant`), so the op scores a
block as ``(q * scales) @ codes + q @ biases``: one multiply-add of 16 tokens' codes per
channel, no dequantized key row. Values are per-token rows dequantized as read. A block
still residual is read exact; rotated sides are met inside the op (queries rotated for the
quantized keys, the exact rows' weighted value sum rotated into the quantized rows' space,
the output rotated back).

A prefill chunk runs on the extension's flash prefill kernel over a small float pool built
for the call: the quantized rows of the blocks before the chunk's last block (dequantized
as the reference does) and the exact rows of the chunk's blocks. Each block of the chunk
becomes one row of a batch: its queries see the blocks before it quantized and itself
exact (causal), which is the rule; the chunk's first and last blocks are padded with zero
queries whose outputs are dropped.
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


def paged_decode(queries: mx.array, k_pool: ResidualBlocks, v_pool: ResidualBlocks,
                 block_tables: mx.array, context_lens: Sequence[int] | mx.array,
                 scale: float | AttentionSpec, **_) -> mx.array:
    """Decode attention (queries (B, Hq, 1, D)) over a residual pool by its rule: a row's
    own block exact where the residual map holds it, the others quantized; (B, Hq, 1, D)."""
    spec = AttentionSpec.of(scale)
    kq, vq = k_pool.quantized, v_pool.quantized
    rotated = k_pool.rotated or v_pool.rotated
    return build.require().paged_residual_decode(
        queries, kq.data, kq.scales, kq.biases, vq.data, vq.scales, vq.biases,
        k_pool.residual, v_pool.residual, k_pool.res_map.astype(mx.int32),
        block_tables.astype(mx.int32), cpu.lens_array(context_lens),
        scale=float(spec.scale), k_bits=kq.bits, v_bits=vq.quant.bits,
        v_group=vq.quant.group_size, sinks=spec.sinks,
        rotation=rotation.signs(queries.shape[-1]) if rotated else None,
        rotate_k=k_pool.rotated, rotate_v=v_pool.rotated, window=spec.window or 0)


def _chunk(queries: mx.array, k_pool: ResidualBlocks, v_pool: ResidualBlocks,
           table: mx.array, n: int, spec: AttentionSpec) -> mx.array:
    """One sequence's L newest queries (positions n - L .. n - 1), (1, Hq, L, D)."""
    _, Hq, L, D = queries.shape
    bs = k_pool.shape[2]
    first, last = (n - L) // bs, (n - 1) // bs
    span = last - first + 1  # the chunk's blocks: one batch row each

    # a window's first block for the chunk's first query: no query reads the blocks before
    # it, so they are not dequantized (their table entries name block 0, never read)
    w0 = 0 if spec.window is None else max(0, n - L - spec.window + 1) // bs

    def pool(side: ResidualBlocks) -> mx.array:
        exact = side.exact_rows(table[first:last + 1])
        if last == w0:
            return exact
        return mx.concatenate([side.quantized_rows(table[w0:last]).astype(exact.dtype), exact],
                              axis=1)

    # row j: blocks w0 .. first + j - 1 quantized (pool ids from 0), its own block exact
    rows = [[0] * w0 + list(range(first + j - w0)) + [last - w0 + j] + [0] * (span - 1 - j)
            for j in range(span)]
    lens = [(first + j + 1) * bs for j in range(span)]
    front, back = n - L - first * bs, (last + 1) * bs - n
    q = mx.pad(queries, [(0, 0), (0, 0), (front, back), (0, 0)])
    q = q.reshape(Hq, span, bs, D).swapaxes(0, 1)  # (span, Hq, bs, D)
    out = cpu.paged_prefill(q, pool(k_pool), pool(v_pool), mx.array(rows, dtype=mx.int32),
                            lens, spec)
    return out.swapaxes(0, 1).reshape(1, Hq, span * bs, D)[:, :, front:front + L]


def paged_prefill(queries: mx.array, k_pool: ResidualBlocks, v_pool: ResidualBlocks,
                  block_tables: mx.array, context_lens: Sequence[int],
                  scale: float | AttentionSpec, **_) -> mx.array:
    """Causal attention of each sequence's L newest queries (B, Hq, L, D) by the rule,
    one sequence at a time (each over exactly its own blocks, so batching changes no row)."""
    spec = AttentionSpec.of(scale)
    bs = k_pool.shape[2]
    outs = [_chunk(queries[b:b + 1], k_pool, v_pool, block_tables[b, :-(-int(n) // bs)],
                   int(n), spec) for b, n in enumerate(context_lens)]
    return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)


def launch(*args, **_) -> mx.array:
    """The decode op for one query per sequence, else the prefill route above."""
    return (paged_decode if args[0].shape[2] == 1 else paged_prefill)(*args)


def variant_key(call: PagedCall) -> tuple:
    """What the first-launch check tells apart: the kind, dtypes, GQA, dims, bits, rotation."""
    k, v = call.k_pool, call.v_pool
    return ("residual", call.kind != "decode", call.queries.dtype, call.gqa_ratio,
            call.queries.shape[3], k.shape[2], k.quantized.bits, v.quantized.quant.bits,
            v.quantized.quant.group_size, k.residual.dtype, k.rotated, v.rotated)
