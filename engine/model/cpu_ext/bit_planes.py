"""5- and 6-bit weights in the tiled layout: a 4-bit nibble layout plus bit planes.

MLX packs 5/6-bit codes as one little-endian bit stream (code k at bits k*b..k*b+b-1 of the
row's uint32 words). The tiled kernels (csrc/qmm_tiled_impl.h, ``quad_bytes``) read them as
the 4-bit layout's 64-byte blocks (quads 2p and 2p + 1 of a tile-group in the low and high
nibbles of 16 rows x 4 bytes) each followed by the bits above the nibble: per quad (2p,
then 2p + 1) and plane h (bit 4 + h), 8 bytes whose bit 4i + b is that bit of row i's
weight 4j + b. A block is 16 x bits bytes, so a row keeps ``K * bits / 8`` bytes: the same
size as MLX's, another order. Why: GGUF's Q5 codes are exact in 5 bits (they took 8 before)
and Q6_K's re-quantization fits 6, ~1/3 and ~1/4 fewer bytes to hold and to read a step.
"""

from __future__ import annotations

import mlx.core as mx

TILE_ROWS = 16
BITS = (5, 6)


def unpack_codes(w: mx.array, bits: int) -> mx.array:
    """MLX-packed ``bits``-bit rows (..., K * bits / 32) uint32 -> codes (..., K) uint8."""
    *lead, packed = w.shape
    K = packed * 32 // bits
    stream = (w[..., None] >> mx.arange(32, dtype=mx.uint32)) & 1  # (..., packed, 32)
    stream = stream.astype(mx.uint8).reshape(*lead, K, bits)
    return (stream << mx.arange(bits, dtype=mx.uint8)).sum(-1).astype(mx.uint8)


def pack_codes(codes: mx.array, bits: int) -> mx.array:
    """codes (..., K) -> MLX's ``bits``-bit packing (..., K * bits / 32) uint32."""
    *lead, K = codes.shape
    # the bit stream a byte at a time (little-endian words are their bytes in order): a
    # bit per uint8, where a bit per uint32 took ~50 MiB for a 512-token lookup
    stream = (codes[..., None] >> mx.arange(bits, dtype=mx.uint8)) & 1
    stream = stream.reshape(*lead, K * bits // 8, 8) << mx.arange(8, dtype=mx.uint8)
    packed = stream.sum(-1).astype(mx.uint8)
    return packed.reshape(*lead, K * bits // 32, 4).view(mx.uint32).squeeze(-1)


def widen_to_8(w: mx.array, bits: int) -> mx.array:
    """MLX-packed 5/6-bit rows as 8-bit ones: the same codes, so with the same scales and
    biases the same weights (for the extension's untiled path, which reads 4 and 8 bits)."""
    codes = unpack_codes(w, bits)
    return codes.reshape(*codes.shape[:-1], -1, 4).view(mx.uint32).squeeze(-1)


def tile_rows(w: mx.array, group_size: int, bits: int) -> mx.array:
    """MLX-packed 5/6-bit ``w`` (rows in 16s) in the tiled layout (same shape and dtype)."""
    N, packed = w.shape
    K = packed * 32 // bits
    T, G, P, H = N // TILE_ROWS, K // group_size, group_size // 8, bits - 4
    codes = unpack_codes(w, bits).reshape(T, TILE_ROWS, G, P, 2, 4)  # (t, i, g, p, half, b)
    codes = codes.transpose(0, 2, 3, 4, 1, 5)  # (t, g, p, half, i, b)
    low = codes & 0xF
    nibbles = low[:, :, :, 0] | (low[:, :, :, 1] << 4)  # (t, g, p, i, b): 64 bytes
    planes = mx.stack([(codes >> (4 + h)) & 1 for h in range(H)], axis=4)  # (t,g,p,half,h,i,b)
    planes = planes.reshape(T, G, P, 2, H, 8, 8) << mx.arange(8, dtype=mx.uint8)
    planes = planes.sum(-1).astype(mx.uint8)  # (t, g, p, half, h, 8 bytes)
    blocks = mx.concatenate([nibbles.reshape(T, G, P, 64), planes.reshape(T, G, P, 16 * H)],
                            axis=-1)
    return blocks.reshape(N, K * bits // 8).view(mx.uint32).reshape(N, packed)


def untile_codes(w: mx.array, rows: mx.array, group_size: int, bits: int) -> mx.array:
    """The codes (..., K) uint8 of rows ``rows`` (any int shape) of `tile_rows`'s layout
    (`pack_codes` gives them MLX's packing).

    Only the bytes of the rows asked for are gathered (a row's nibbles, and the one plane
    byte per quad and plane that holds its bits): slicing the blocks first copied the whole
    matrix, ~100 MiB a lookup for a 1B model's 6-bit embedding."""
    N, packed = w.shape
    K = packed * 32 // bits
    G, P, H, B = K // group_size, group_size // 8, bits - 4, 16 * bits
    t, i = (rows // TILE_ROWS).astype(mx.uint32), (rows % TILE_ROWS).astype(mx.uint32)
    flat = w.view(mx.uint8).reshape(-1)
    gp = mx.arange(G * P, dtype=mx.uint32).reshape(G, P)

    def at(a: mx.array) -> mx.array:  # per asked row, broadcast over (g, p)
        return a.reshape(*rows.shape, 1, 1)

    base = ((at(t) * (G * P) + gp) * B)[..., None]  # (..., G, P, 1): the block's first byte
    b4 = mx.arange(4, dtype=mx.uint32)
    nib = flat[base + at(i)[..., None] * 4 + b4]  # (..., G, P, b): row i's 4 nibble bytes
    low = mx.stack([nib & 0xF, nib >> 4], axis=-2)  # (..., G, P, half, b)
    # bit 4i + b of plane bytes (half, h): byte i // 2, bit 4 (i % 2) + b
    planes = (mx.arange(2 * H, dtype=mx.uint32) * 8).reshape(2, H)
    byte = flat[base[..., None] + 64 + planes + at(i // 2)[..., None, None]]  # (.., half, h)
    shift = (4 * (i % 2)).astype(mx.uint8).reshape(*rows.shape, 1, 1, 1, 1) + b4.astype(
        mx.uint8)
    for h in range(H):  # plane by plane in uint8: no (..., half, h, b) array of bits
        low = low | (((byte[..., h, None] >> shift) & 1) << (4 + h))
    return low.reshape(*rows.shape, K)
