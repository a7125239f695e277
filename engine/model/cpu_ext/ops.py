"""Typed wrappers of the extension's matmul, K/V write and greedy primitives (build it first:
`build.available()`); its attention is `engine.model.attention.cpu`'s."""

from __future__ import annotations

import os

import mlx.core as mx

from engine.model.cpu_ext import bit_planes, build

QMM_BITS = (4, 8)
TILED_BITS = (4, 5, 6, 8)  # 5 and 6: the tiled layout only (`bit_planes`)
QMM_GROUP_SIZES = (32, 64, 128)
FLOAT_DTYPES = (mx.float32, mx.float16, mx.bfloat16)


def qmm(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, *, group_size: int,
        bits: int, tiled: bool = False) -> mx.array:
    """``x @ dequantize(w, scales, biases).T``: `mx.quantized_matmul` with ``transpose=True``.

    Args:
        x: (..., K) float32, float16 or bfloat16.
        w: (N, K * bits / 32) uint32, packed by `mx.quantize` (affine mode).
        scales, biases: (N, K / group_size), one float dtype; with ``tiled``, biases may be
            (1, 1): a symmetric format's factor, each bias that times its scale.
        group_size: 32, 64 or 128.
        bits: 4 or 8.
        tiled: w, scales and biases are in the tiled layout (`tile`), and
            x is multiplied as int16 per group (AVX-512 VNNI; `tiled_supported`), or as
            int8 in `set_activation_bits(8)` mode.

    Returns:
        (..., N) in the promoted dtype of x and scales; accumulated in float32.
    """
    return build.require().qmm(x, w, scales, biases, group_size=group_size, bits=bits,
                               tiled=tiled)


def kv_write(pool: mx.array, slots: mx.array, rows: mx.array) -> mx.array:
    """``pool`` (H, S, ...) with ``rows`` (H, N, ...) written at ``slots`` (N,) as one op:
    what ``pool[:, slots] = rows`` computes (float rows cast to a float pool's dtype; other
    pools, such as quantized codes, take rows of their own dtype), in place when the pool is
    donated. Slots outside the pool are skipped."""
    slots = slots.astype(mx.int32) if slots.dtype != mx.int32 else slots
    return build.require().kv_write(pool, slots, rows)


def channel_quant(res: mx.array, at: mx.array, block_size: int, bits: int,
                  rotation: bool) -> tuple[mx.array, mx.array, mx.array]:
    """Per-channel key codes, scales and biases of the blocks whose residual rows are ``at``
    in ``res`` (H, rows * block_size, D): one op, bit for bit what
    `channel_quant.quantize_channels` stores from those rows (rotated first when asked)."""
    from engine.kvcache import rotation as rot

    signs = rot.signs(res.shape[-1]) if rotation else None
    return tuple(build.require().channel_quant(res, at.astype(mx.int32), block_size=block_size,
                                               bits=bits, signs=signs))


def kv_write_quant(store: tuple[mx.array, mx.array, mx.array], slots: mx.array,
                   rows: mx.array, quant) -> tuple[mx.array, mx.array, mx.array]:
    """A quantized pool's (packed rows, scales, biases), each (H, S, ·), with ``rows``
    (H, N, D) written at ``slots``: what `PagedKVCache.write` stores through `mx.quantize`,
    as one op per part, each in place when donated. Rotated rows (``quant.rotation``) go
    through a fast Walsh-Hadamard transform of each row alone, so a row's bytes never
    depend on the rows written with it (`rotation.rotate`'s GEMM may round them
    differently in the last bit)."""
    from engine.kvcache import rotation

    slots = slots.astype(mx.int32) if slots.dtype != mx.int32 else slots
    signs = rotation.signs(rows.shape[-1]) if quant.rotation else None
    ext = build.require()
    return tuple(ext.kv_write_quant(part, slots, rows, signs, part=i, bits=quant.bits,
                                    group=quant.group_size) for i, part in enumerate(store))


def kv_write_sides(keys, values, slots: mx.array, k_rows: mx.array, v_rows: mx.array,
                   k_quant, v_quant) -> tuple:
    """A layer's K and V stores (each an array, or a quantized side's (packed rows, scales,
    biases) as its ``QuantSpec`` says) with the rows (H, N, D) written at ``slots``, as one
    op for both sides: the bytes `kv_write` / `kv_write_quant` store side by side, each
    array in place when nothing else holds it."""
    from engine.kvcache import rotation

    slots = slots.astype(mx.int32) if slots.dtype != mx.int32 else slots
    kw, signs = {}, None
    for side, q in (("k", k_quant), ("v", v_quant)):
        if q is not None:
            kw |= {f"{side}_bits": q.bits, f"{side}_group": q.group_size,
                   f"rotate_{side}": bool(q.rotation)}
            signs = rotation.signs(k_rows.shape[-1]) if q.rotation else signs
    ks, vs = (list(x) if isinstance(x, tuple) else [x] for x in (keys, values))
    out = build.require().kv_write_sides(ks, vs, slots, k_rows, v_rows, signs, **kw)
    k, v = out[:len(ks)], out[len(ks):]
    return (tuple(k) if k_quant else k[0]), (tuple(v) if v_quant else v[0])


def greedy_pick(logits: mx.array) -> mx.array:
    """(rows, vocab) float logits -> (rows,) int32: each row's greedy token where it provably
    equals mlx-lm's ``argmax(logits - logsumexp(logits))`` (see csrc/greedy.cpp), else -1."""
    return build.require().greedy_pick(logits)


def tiled_supported() -> bool:
    """Whether the extension has the tiled matmul (built with AVX-512 VNNI)."""
    return bool(build.require().tiled_supported())


def set_activation_bits(bits: int) -> None:
    """How the tiled matmul quantizes activations per weight group: 16 (the default, ~f16
    precision) or 8 (llama.cpp's Q8_0 way: twice the multiply rate, some perplexity; the
    prefill kernel is compute-bound on it). Process-wide; read when each product runs."""
    build.require().set_activation_bits(int(bits))


def activation_bits() -> int:
    """The tiled matmul's activation bits (8 or 16)."""
    return int(build.require().activation_bits())


ACTIVATIONS_ENV = "KVCHAT_ACTIVATIONS"  # int8 | int16: read by the extension when it loads


def request_activations(choice: str) -> None:
    """``--activations``: the mode for this process and those it starts (the environment,
    read when the extension loads), applied now if the extension is already loaded."""
    if choice not in ("int8", "int16"):
        raise ValueError(f"activations must be int8 or int16, not {choice!r}")
    os.environ[ACTIVATIONS_ENV] = choice
    if build.loaded() is not None:
        set_activation_bits(8 if choice == "int8" else 16)


TILE_ROWS = 16
TILE_CHUNK_WEIGHTS = 1 << 23  # weights `tile` re-lays at a time


def tile(w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int,
         ) -> tuple[mx.array, mx.array, mx.array]:
    """MLX 4/5/6/8-bit affine weights (N, K * bits / 32) rearranged into the tiled layout `qmm`
    reads with ``tiled=True``; same shapes, dtypes and bytes, another order.

    Rows go in tiles of 16. For tile t, group g and quad j (4 weights) of the group,
    16 rows x 4 bytes: byte 4i + b is weight ``g * group + 4j + b`` of row ``16t + i``
    (one int32 lane per row). 4 bits: quads 2p and 2p + 1 share 64 bytes, 2p in the low
    nibbles (5/6 bits: `bit_planes`). Scales and biases go (t, g, i). Row slices at
    multiples of 16 stay valid tiles.
    """
    N, packed = w.shape
    K = packed * 32 // bits
    G = K // group_size
    if (N % TILE_ROWS or group_size % 32 or w.dtype != mx.uint32 or bits not in TILED_BITS
            or scales.shape != (N, G)):
        raise ValueError(f"tile: needs rows in 16s, groups of 32s and 4/5/6/8-bit uint32 w, "
                         f"not {w.shape}")
    T = N // TILE_ROWS
    # Rows at a time, each part evaluated: unpacking 4-bit codes takes 4 bytes a weight, a
    # whole tied embedding's ~0.5 GB at load for a 1B model (its peak memory); 5/6-bit ones
    # go through a bit stream of 4 bytes a bit
    chunk = TILE_CHUNK_WEIGHTS // (8 if bits in bit_planes.BITS else 1)
    step = max(TILE_ROWS, chunk // K // TILE_ROWS * TILE_ROWS)
    if step < N:
        parts = []
        for r0 in range(0, N, step):
            parts.append(_tile_rows(w[r0:r0 + step], group_size, bits))
            mx.eval(parts[-1])
        tiled = mx.concatenate(parts)
    else:
        tiled = _tile_rows(w, group_size, bits)

    def params(a: mx.array) -> mx.array:
        if a.size == 1 and a.shape != scales.shape:  # a symmetric format's one bias factor
            return a
        return a.reshape(T, TILE_ROWS, G).transpose(0, 2, 1).reshape(N, G)

    return tiled, params(scales), params(biases)


def _tile_rows(w: mx.array, group_size: int, bits: int) -> mx.array:
    """`tile`'s packed weights for ``w`` (rows in 16s): the extension's op for 4 and 8 bits
    (MLX's ops below re-laid ~65 M weights a second: ~38 s of a 64-expert model's load)."""
    if bits in bit_planes.BITS:
        return bit_planes.tile_rows(w, group_size, bits)
    return build.require().tile_rows(w, group_size=group_size, bits=bits)


def tile_rows_mlx(w: mx.array, group_size: int, bits: int) -> mx.array:
    """`_tile_rows` of 4/8-bit ``w`` by MLX's ops: the layout spelled out (the tests' oracle)."""
    N, packed = w.shape
    K = packed * 32 // bits
    T, G = N // TILE_ROWS, K // group_size
    if bits == 8:
        q = w.view(mx.uint8).reshape(T, TILE_ROWS, G, group_size // 4, 4)  # (t, i, g, j, b)
        return q.transpose(0, 2, 3, 1, 4).reshape(N, K).view(mx.uint32).reshape(N, packed)
    shifts = mx.arange(0, 32, 4, dtype=mx.uint32)
    q = ((w[:, :, None] >> shifts) & 0xF).astype(mx.uint8)  # (N, K / 8, 8): natural order
    q = q.reshape(T, TILE_ROWS, G, group_size // 8, 2, 4)  # (t, i, g, p, half, b)
    q = q.transpose(0, 2, 3, 4, 1, 5)  # (t, g, p, half, i, b)
    return (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).reshape(N, K // 2).view(mx.uint32).reshape(
        N, packed)


def untile_rows(w: mx.array, scales: mx.array, biases: mx.array, rows: mx.array,
                group_size: int, bits: int, *, packed: bool = True
                ) -> tuple[mx.array, mx.array, mx.array]:
    """Rows ``rows`` (any int shape) of `tile`d weights back in MLX's layout: what
    ``w[rows], scales[rows], biases[rows]`` gave before tiling (an embedding lookup). A
    (1, 1) ``biases`` (a symmetric format's factor) gives each row's biases as that factor
    times its scales (exact: the factor is a power of two). 5/6 bits with ``packed=False``:
    the codes (..., K) uint8 in place of MLX's packing."""
    if biases.size == 1 and biases.shape != scales.shape:
        data, s, _ = untile_rows(w, scales, scales, rows, group_size, bits, packed=packed)
        return data, s, s * biases.reshape(())
    if bits == 8:
        return untile8_rows(w, scales, biases, rows, group_size)
    N, G = scales.shape
    t, i = rows // TILE_ROWS, rows % TILE_ROWS

    def params(a: mx.array) -> mx.array:
        return a.reshape(N // TILE_ROWS, G, TILE_ROWS).transpose(0, 2, 1)[t, i]

    if bits in bit_planes.BITS:
        codes = bit_planes.untile_codes(w, rows, group_size, bits)
        data = bit_planes.pack_codes(codes, bits) if packed else codes
        return data, params(scales), params(biases)
    N, words = w.shape
    K, T = words * 8, N // TILE_ROWS
    # (t, g, p, i, b): byte b of row i holds quad 2p's weight in its low nibble, 2p + 1's high
    q = w.view(mx.uint8).reshape(T, G, group_size // 8, TILE_ROWS, 4).transpose(0, 3, 1, 2, 4)
    q = q[t, i]  # (..., G, P, 4)
    codes = mx.stack([q & 0xF, q >> 4], axis=-2).reshape(*rows.shape, K)  # natural order
    data = (codes[..., 0::2] | (codes[..., 1::2] << 4)).view(mx.uint32)
    return data, params(scales), params(biases)


def lookup_rows(w: mx.array, scales: mx.array, biases: mx.array, rows: mx.array,
                group_size: int, bits: int) -> mx.array:
    """Rows ``rows`` of `tile`d weights dequantized: ``mx.dequantize`` of `untile_rows`,
    the same values. 5/6-bit codes are scaled as they are gathered (code x scale + bias in
    the scales' dtype: MLX's dequantize, bit for bit), not packed again first: re-packing a
    512-token lookup's codes took ~25 MiB."""
    if bits == 8 and biases.shape in (scales.shape, (1, 1)):  # one op, the same bits
        return build.require().tiled_rows8(w, scales, biases, rows.astype(mx.int32), group_size)
    if bits not in bit_planes.BITS:
        w, s, b = untile_rows(w, scales, biases, rows, group_size, bits)
        return mx.dequantize(w, scales=s, biases=b, group_size=group_size, bits=bits)
    codes, s, b = untile_rows(w, scales, biases, rows, group_size, bits, packed=False)
    g = codes.reshape(*rows.shape, s.shape[-1], group_size).astype(s.dtype)
    return (g * s[..., None] + b[..., None]).reshape(codes.shape)


def untile8_rows(w: mx.array, scales: mx.array, biases: mx.array, rows: mx.array,
                 group_size: int) -> tuple[mx.array, mx.array, mx.array]:
    """Rows ``rows`` (any int shape) of `tile`d 8-bit weights back in MLX's layout: what
    ``w[rows], scales[rows], biases[rows]`` gave before tiling (an embedding lookup)."""
    N, packed = w.shape
    K, G = packed * 4, scales.shape[1]
    T = N // TILE_ROWS
    t, i = rows // TILE_ROWS, rows % TILE_ROWS
    q = w.view(mx.uint8).reshape(T, G, group_size // 4, TILE_ROWS, 4).transpose(0, 3, 1, 2, 4)
    data = q[t, i].reshape(*rows.shape, K).view(mx.uint32)

    def params(a: mx.array) -> mx.array:
        return a.reshape(T, G, TILE_ROWS).transpose(0, 2, 1)[t, i]

    return data, params(scales), params(biases)
