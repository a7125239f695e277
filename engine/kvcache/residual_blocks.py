"""`ResidualBlocks`: one side (K or V) of a residual-format layer, as attention reads it.

A block is in one of two states: *residual* (a row of the side store in the compute dtype,
exact; the newest, partly filled block of a sequence, and a block in the step it fills) or
*quantized* (full, in the quantized store). ``res_map[b]`` is block b's residual row or -1.

What a query reads (`engine.model.attention.residual`): the blocks before its own block
quantized, its own block exact. This rule depends on the query's position only, never on
how a prompt was cut into chunks or batched with others, so cold, cached and batched runs
compute the same thing.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from engine.kvcache import rotation
from engine.kvcache.channel_quant import ChannelBlocks
from engine.kvcache.quantized_blocks import QuantizedBlocks


@dataclass(frozen=True, slots=True)
class ResidualBlocks:
    """Quantized full blocks plus exact residual blocks, viewed (kv_heads, num_blocks,
    block_size, head_dim); ``rotated``: the quantized rows are stored rotated
    (`kvcache.rotation`) and are rotated back here, so attention sees plain rows."""

    quantized: QuantizedBlocks | ChannelBlocks
    residual: mx.array  # (kv_heads, num_residual, block_size, head_dim), compute dtype
    res_map: mx.array  # (num_blocks,) int32
    rotated: bool

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return self.quantized.shape

    @property
    def dtype(self) -> mx.Dtype:
        return mx.uint8  # not float rows: every kernel's `supports` declines this pool

    def quantized_rows(self, block_table: mx.array) -> mx.array:
        """(H, *table, bs, D) rows of the blocks as quantized (rotated back)."""
        rows = self.quantized.gather(block_table)
        if not self.rotated:
            return rows
        shape = rows.shape
        return rotation.unrotate(rows.reshape(shape[0], -1, shape[-1])).reshape(shape)

    def exact_rows(self, block_table: mx.array) -> mx.array:
        """(H, *table, bs, D) residual rows of the blocks (only meaningful where mapped)."""
        return self.residual[:, mx.maximum(self.res_map[block_table], 0)]

    def gather(self, block_table: mx.array) -> mx.array:
        """Each block exact where it is residual, else dequantized: what a decode query
        reads once only its own block is mapped (`attention.residual`)."""
        mapped = (self.res_map[block_table] >= 0)[None, ..., None, None]
        return mx.where(mapped, self.exact_rows(block_table),
                        self.quantized_rows(block_table).astype(self.residual.dtype))

    def run(self, start: int, stop: int) -> mx.array:
        """Token rows ``start:stop`` of a contiguous run, (kv_heads, n, head_dim)."""
        H, _, bs, D = self.shape
        first = start // bs
        blocks = mx.arange(first, -(-stop // bs), dtype=mx.int32)
        return self.gather(blocks).reshape(H, -1, D)[:, start - first * bs:stop - first * bs]
