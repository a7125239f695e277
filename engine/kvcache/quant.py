"""An affine quantized K or V format, shared by the pool (`kv_cache`) and the disk store.

MLX's affine format (`mx.quantize`): each row of ``head_dim`` elements is packed into uint32
words of ``bits`` per element, plus one float16 scale and bias per group of ``group_size``
elements. One type for both sides, so a block the pool stores and a block the disk holds
can never disagree on what a format is or on its shapes.

No MLX here: the disk store's modules load without it (a crash test runs them in a bare child).
"""

from __future__ import annotations

from dataclasses import dataclass

SCALE_DTYPE = "float16"  # per-group scale and bias, as llama.cpp's q8_0 / q4_1 keep them
SCALE_BYTES = 2
# Every width `mx.quantize` packs, not only the pool's 4 and 8 today (`kv_cache.POOL_BITS`):
# the disk format must never be what refuses a pool format, nor call another kvchat's corrupt.
BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)
# 0: rows stored as they are; 1: rotated before quantization by kvchat's random-sign
# Hadamard (`kvcache.rotation`). A new rotation gets a new number: entries never mix.
ROTATIONS = (0, 1)
MIN_ROTATION_BLOCK = 16  # the rotation mixes power-of-two blocks of at least this width


@dataclass(frozen=True, slots=True)
class QuantSpec:
    """An affine quantized format: ``bits`` per element, one scale and bias per group.

    Attributes:
        bits (int): one of `BITS`.
        group_size (int): elements per scale and bias, one of `GROUP_SIZES`. Default: 64.
        rotation (int): one of `ROTATIONS`; rows are rotated before they are quantized
            (and attention rotates queries and outputs to match). Default: 0.
    """

    bits: int
    group_size: int = 64
    rotation: int = 0

    def __post_init__(self):
        # exact ints: a forged header's 8.0 or True must not pass for a format
        if type(self.bits) is not int or self.bits not in BITS:
            raise ValueError(f"KV bits must be one of {BITS}, got {self.bits!r}")
        if type(self.group_size) is not int or self.group_size not in GROUP_SIZES:
            raise ValueError(f"KV group size must be 32, 64 or 128, got {self.group_size!r}")
        if type(self.rotation) is not int or self.rotation not in ROTATIONS:
            raise ValueError(f"KV rotation must be one of {ROTATIONS}, got {self.rotation!r}")

    @property
    def name(self) -> str:
        rotated = f"r{self.rotation}" if self.rotation else ""
        return f"q{self.bits}g{self.group_size}{rotated}"

    def fits(self, head_dim: int) -> bool:
        """Whether rows of ``head_dim`` split into whole groups and whole uint32 words (and,
        rotated, into power-of-two blocks of `MIN_ROTATION_BLOCK` or more)."""
        rotatable = not self.rotation or rotation_block(head_dim) >= MIN_ROTATION_BLOCK
        return head_dim % self.group_size == 0 and head_dim * self.bits % 32 == 0 and rotatable

    def packed_dim(self, head_dim: int) -> int:
        """uint32 words of one packed row."""
        return head_dim * self.bits // 32

    def num_groups(self, head_dim: int) -> int:
        """Scales (and biases) of one row."""
        return head_dim // self.group_size

    def bytes_per_row(self, head_dim: int) -> int:
        """Packed elements plus the float16 scale and bias of each group."""
        return head_dim * self.bits // 8 + self.num_groups(head_dim) * 2 * SCALE_BYTES


def rotation_block(head_dim: int) -> int:
    """Width of the Hadamard blocks rotating a row: the largest power of two dividing it."""
    return head_dim & -head_dim
