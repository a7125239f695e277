"""Keys quantized per channel within a block (KIVI's layout on the paged pool).

A key row of this model family carries a few outlier channels ~100x the others, and those
channels keep their magnitude from token to token. One scale per token row spends its levels
on the outliers; one scale per *channel* over a block's ``block_size`` tokens fits each
channel's own range instead (KIVI, KVQuant). A block is quantized once, when it is full
(`kvcache.residual` keeps it in the compute dtype until then), so a group is exactly one
block's tokens and a block never mixes with another.

Stored per layer, block-major: data ``(kv_heads, num_blocks, head_dim, block_size * bits / 8)``
uint8 (two 4-bit codes per byte, low nibble first), scales and biases ``(kv_heads, num_blocks,
head_dim)`` float16. ``x = code * scale + bias``, with the code computed against the float16
scale and bias that are stored, so a block's bytes depend only on its rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

CHANNEL_BITS = (4, 8)


def packed_width(block_size: int, bits: int) -> int:
    """Bytes of one channel's codes in one block."""
    return block_size * bits // 8


def quantize_channels(blocks: mx.array, bits: int) -> tuple[mx.array, mx.array, mx.array]:
    """(H, n, block_size, D) rows of n full blocks -> (data, scales, biases) as stored."""
    levels = (1 << bits) - 1
    x = blocks.astype(mx.float32).swapaxes(-1, -2)  # (H, n, D, bs): a channel's tokens last
    lo, hi = x.min(axis=-1), x.max(axis=-1)
    scales = ((hi - lo) / levels).astype(mx.float16)
    biases = lo.astype(mx.float16)
    s = scales.astype(mx.float32)
    s = mx.where(s > 0, s, 1.0)[..., None]  # a constant channel: every code 0
    codes = mx.clip(mx.round((x - biases.astype(mx.float32)[..., None]) / s), 0, levels)
    codes = codes.astype(mx.uint8)
    if bits == 4:
        codes = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return codes, scales, biases


def dequantize_channels(data: mx.array, scales: mx.array, biases: mx.array,
                        bits: int) -> mx.array:
    """(..., D, packed) codes with (..., D) scales and biases -> (..., block_size, D) float16."""
    if bits == 4:
        codes = mx.stack([data & 15, data >> 4], axis=-1).reshape(*data.shape[:-1], -1)
    else:
        codes = data
    x = codes.astype(mx.float32) * scales.astype(mx.float32)[..., None] \
        + biases.astype(mx.float32)[..., None]
    return x.astype(mx.float16).swapaxes(-1, -2)


def empty_store(num_kv_heads: int, num_blocks: int, block_size: int, head_dim: int,
                bits: int) -> tuple[mx.array, mx.array, mx.array]:
    """A zeroed per-channel K store of ``num_blocks`` blocks."""
    lead = (num_kv_heads, num_blocks, head_dim)
    return (mx.zeros((*lead, packed_width(block_size, bits)), mx.uint8),
            mx.zeros(lead, mx.float16), mx.zeros(lead, mx.float16))


@dataclass(frozen=True, slots=True)
class ChannelBlocks:
    """One layer's per-channel K store viewed as ``(kv_heads, num_blocks, block_size, D)``."""

    data: mx.array
    scales: mx.array
    biases: mx.array
    bits: int
    block_size: int

    @property
    def shape(self) -> tuple[int, int, int, int]:
        H, nb, D, _ = self.data.shape
        return (H, nb, self.block_size, D)

    def gather(self, block_table: mx.array) -> mx.array:
        """Rows of the blocks ``block_table`` (any index shape), dequantized (float16)."""
        return dequantize_channels(self.data[:, block_table], self.scales[:, block_table],
                                   self.biases[:, block_table], self.bits)
