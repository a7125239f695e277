"""A quantized side of one layer's KV pool, viewed block-wise for attention."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from engine.kvcache.quant import QuantSpec


@dataclass(frozen=True, slots=True)
class QuantizedBlocks:
    """One layer's quantized K or V viewed as ``(kv_heads, num_blocks, block_size, ·)``.

    ``dtype`` is uint32 (the packed data), so kernels that take float pools decline it
    and attention reads it through `gather` / `run`, which dequantize only what they read.
    """

    data: mx.array
    scales: mx.array
    biases: mx.array
    quant: QuantSpec
    head_dim: int

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (*self.data.shape[:3], self.head_dim)

    dtype = property(lambda self: self.data.dtype)  # mx.Dtype

    def _dequantize(self, data, scales, biases) -> mx.array:
        q = self.quant
        return mx.dequantize(data, scales, biases, group_size=q.group_size, bits=q.bits)

    def gather(self, block_table: mx.array) -> mx.array:
        """Rows of the blocks ``block_table`` (any index shape), dequantized."""
        return self._dequantize(self.data[:, block_table], self.scales[:, block_table],
                                self.biases[:, block_table])

    def run(self, start: int, stop: int) -> mx.array:
        """Token rows ``start:stop`` of a contiguous run, as (kv_heads, n, head_dim)."""
        H = self.data.shape[0]
        parts = [a.reshape(H, -1, a.shape[-1])[:, start:stop]
                 for a in (self.data, self.scales, self.biases)]
        return self._dequantize(*parts)
