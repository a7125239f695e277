"""Attention over a block-paged KV pool: the reference path (pure MLX).

Contract shared with the Metal/CUDA kernels (metal_kernels/):
    paged_attention(queries, k_pool, v_pool, block_tables, context_lens, scale)
- queries: (B, Hq, L, D), the L newest positions of each sequence;
- k_pool, v_pool: (Hkv, num_blocks, block_size, D), Hq % Hkv == 0 (GQA).
  Head-major so that one sequence's gathered blocks are already the
  contiguous (Hkv, T, D) that attention wants: no transpose copy per step.
  Either may be `QuantizedBlocks` (mx.quantize rows): the reference dequantizes
  the gathered blocks, the kernels dequantize in registers;
- block_tables: (B, max_blocks) int32, physical block ids; entries past a
  sequence's last block are padding (any valid id, never read unmasked);
- context_lens: B host ints, tokens in each sequence *including* the L new ones
  (already written to the pool); query i of sequence b sits at position
  context_lens[b] - L + i and sees keys 0..that position (causal);
- returns (B, Hq, L, D) in the queries' dtype.
Optional ``block_run=s`` (reference path, B == 1): the caller knows the
sequence's blocks are the contiguous run s, s+1, ...; K/V are then read as a
view of the pool instead of gathered (the gather copies every step on CPU).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx

from engine.kvcache.kv_cache import QuantizedBlocks
from engine.model import kernels
from engine.model.cpu_ext.attention import cpu_attention


def gather_blocks(pool: mx.array | QuantizedBlocks, block_tables: mx.array) -> mx.array:
    """(H, num_blocks, bs, D) pool -> (B, H, max_blocks * bs, D) K or V.

    A quantized pool is dequantized after the gather: only the blocks read.
    """
    B, nb = block_tables.shape
    H, _, bs, D = pool.shape
    take = pool.gather if isinstance(pool, QuantizedBlocks) else (lambda t: pool[:, t])
    if B == 1:
        return take(block_tables[0]).reshape(1, H, nb * bs, D)
    return take(block_tables).reshape(H, B, nb * bs, D).transpose(1, 0, 2, 3)


def _run_rows(pool: mx.array | QuantizedBlocks, start: int, stop: int) -> mx.array:
    """(1, H, stop - start, D): a contiguous run of token rows, a view when not quantized."""
    if isinstance(pool, QuantizedBlocks):
        return pool.run(start, stop)[None]
    H, _, _, D = pool.shape
    return pool.reshape(H, -1, D)[None, :, start:stop]


def causal_mask(context_lens: Sequence[int], L: int, T: int) -> mx.array:
    """(B, 1, L, T) boolean mask: query i of seq b sees keys <= its position."""
    lens = mx.array(list(context_lens), dtype=mx.int32)
    q_pos = lens[:, None] - L + mx.arange(L, dtype=mx.int32)[None, :]
    k_pos = mx.arange(T, dtype=mx.int32)
    return (k_pos[None, None, :] <= q_pos[:, :, None])[:, None]


def contiguous_run(block_table: Sequence[int]) -> int | None:
    """The first block id if ``block_table`` is s, s+1, s+2, ...; else None."""
    if not block_table:
        return None
    s = block_table[0]
    return s if all(b == s + i for i, b in enumerate(block_table)) else None


def length_groups(context_lens: Sequence[int], block_size: int) -> list[list[int]]:
    """Batch rows grouped by similar length (ascending), so padding stays under ~2x.

    A ragged decode batch padded to its longest sequence gathers and attends over
    B x longest tokens; one long chat among short ones would multiply the work.
    """
    lens = [int(n) for n in context_lens]
    order = sorted(range(len(lens)), key=lens.__getitem__)
    groups = [[order[0]]]
    for i in order[1:]:
        first = lens[groups[-1][0]]
        if lens[i] > 2 * first and lens[i] - first > 8 * block_size:
            groups.append([i])
        else:
            groups[-1].append(i)
    return groups


def _grouped_decode(queries, k_pool, v_pool, block_tables, context_lens, scale, groups):
    """Decode attention per length group, results put back in the batch's order."""
    bs = k_pool.shape[2]
    outs, order = [], []
    for g in groups:
        lens = [int(context_lens[i]) for i in g]
        idx = mx.array(g, dtype=mx.int32)
        tables = block_tables[idx][:, : -(-max(lens) // bs)]
        outs.append(paged_attention_ref(queries[idx], k_pool, v_pool, tables, lens, scale))
        order += g
    inverse = [0] * len(order)
    for pos, row in enumerate(order):
        inverse[row] = pos
    return mx.concatenate(outs, axis=0)[mx.array(inverse, dtype=mx.int32)]


def paged_attention_ref(
    queries: mx.array,
    k_pool: mx.array,
    v_pool: mx.array,
    block_tables: mx.array,
    context_lens: Sequence[int],
    scale: float,
    *,
    block_run: int | None = None,
) -> mx.array:
    """Gather each sequence's blocks, then `mx.fast.scaled_dot_product_attention`.

    With one sequence the gathered K/V are cut to its exact length so the
    computation is the one a dense cache does (token-exact with mlx-lm).
    """
    B, _, L, _ = queries.shape
    if B > 1 and L == 1:
        groups = length_groups(context_lens, k_pool.shape[2])
        if len(groups) > 1:
            return _grouped_decode(queries, k_pool, v_pool, block_tables, context_lens, scale,
                                   groups)
    if B == 1 and block_run is not None:
        bs = k_pool.shape[2]
        n = int(context_lens[0])
        start, stop = block_run * bs, block_run * bs + n
        keys = _run_rows(k_pool, start, stop).astype(queries.dtype)
        values = _run_rows(v_pool, start, stop).astype(queries.dtype)
        mask = "causal" if L > 1 else None
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale,
                                                    mask=mask)
    keys = gather_blocks(k_pool, block_tables).astype(queries.dtype)
    values = gather_blocks(v_pool, block_tables).astype(queries.dtype)
    if B == 1:
        n = int(context_lens[0])
        keys, values = keys[:, :, :n], values[:, :, :n]
        mask = "causal" if L > 1 else None
    else:
        mask = causal_mask(context_lens, L, keys.shape[2])
    return mx.fast.scaled_dot_product_attention(
        queries, keys, values, scale=scale, mask=mask
    )


@dataclass(frozen=True)
class Route:
    """One row of the decode dispatch table: when it applies, the path, and why."""

    when: str
    path: str  # "view_sdpa" (the reference over a view of the pool), "two_pass" or "kernel"
    reason: str


TWO_PASS_MIN_TOKENS = 4096

# Decode dispatch on Metal/CUDA. Conservative until a Mac has run
# `kvchat bench kernel` (which times every path): where MLX's own zero-copy
# path applies, it is used, and the long-context switch copies MLX's own.
# Rows are tried in order; the first match wins.
DECODE_ROUTES = (
    Route("one sequence whose blocks are one contiguous run", "view_sdpa",
          "a view of the pool costs no copy and MLX's sdpa_vector picks its own one- or "
          "two-pass kernel; no Mac figure yet shows the paged kernels beating it"),
    Route(f"longest sequence >= {TWO_PASS_MIN_TOKENS} tokens", "two_pass",
          "the one-pass kernel has Hq x B threadgroups each walking the whole context; "
          "MLX's sdpa_vector goes two-pass at >= 4096 keys with GQA (>= 1024 on Max/Ultra "
          "chips, v0.32.1), so the same threshold until measured; pass 1 also reads each "
          "K/V row once per KV head instead of once per query head"),
    Route("any other decode (short batches, scattered blocks)", "kernel",
          "the alternative gathers every K/V row into a fresh array each step "
          "(lablup/mlxcel measured that gather at +48% to +56% of attention time)"),
)


def decode_route(batch: int, block_run: int | None, max_context: int) -> Route:
    """The DECODE_ROUTES row for a decode step of `batch` sequences."""
    if batch == 1 and block_run is not None:
        return DECODE_ROUTES[0]
    if max_context >= TWO_PASS_MIN_TOKENS:
        return DECODE_ROUTES[1]
    return DECODE_ROUTES[2]


# First launch of each kernel variant: max |kernel - reference| allowed, as a
# fraction of max(1, max |reference|). Loose (a few ulps of the output dtype
# would do): it is there to catch a miscompiled or misindexed kernel on an
# untested machine, not rounding.
FIRST_LAUNCH_TOLERANCE = {mx.float16: 1e-2, mx.bfloat16: 6e-2, mx.float32: 1e-3}


class KernelMismatch(RuntimeError):
    """A kernel's first launch disagreed with the reference."""


def _check_first_launch(out: mx.array, ref: mx.array) -> None:
    mx.eval(out, ref)  # surfaces build errors now, not at some later mx.eval
    err = mx.abs(out.astype(mx.float32) - ref.astype(mx.float32)).max().item()
    bound = FIRST_LAUNCH_TOLERANCE[ref.dtype] * max(1.0, mx.abs(ref).max().item())
    if not err <= bound:  # NaN fails too
        raise KernelMismatch(f"first launch differs from the reference by {err:.3g} "
                             f"(allowed {bound:.3g})")


KERNEL_PATHS = {"kernel": "paged_decode_attention", "two_pass": "paged_decode_two_pass"}


def kernel_decode(queries, k_pool, v_pool, block_tables, context_lens, scale,
                  path: str = "kernel") -> mx.array | None:
    """Decode through a kernel (`path`: "kernel" or "two_pass") when one applies and
    works; None means "use the reference".

    Each kernel variant's first launch is evaluated and checked against the
    reference; any exception (build, launch, mismatch) drops the kernels for
    the process via `kernels.fall_back`, so generation continues on the reference.
    """
    backend = kernels.active_backend()
    if backend is None or not kernels.supports(queries, k_pool, v_pool):
        return None
    launch = getattr(kernels, KERNEL_PATHS[path])
    key = (backend, *kernels.variant_key(queries, k_pool, v_pool, block_tables, path))
    try:
        out = launch(queries, k_pool, v_pool, block_tables, context_lens, scale)
        if not kernels.is_validated(key):
            ref = paged_attention_ref(queries, k_pool, v_pool, block_tables, context_lens, scale)
            _check_first_launch(out, ref)
            kernels.mark_validated(key)
    except Exception as exc:  # noqa: BLE001 - any failure means: not on this machine
        kernels.fall_back(f"{KERNEL_PATHS[path]} on {backend} failed: "
                          f"{type(exc).__name__}: {exc}")
        return None
    return out


def paged_attention(
    queries: mx.array,
    k_pool: mx.array,
    v_pool: mx.array,
    block_tables: mx.array,
    context_lens: Sequence[int],
    scale: float,
    *,
    block_run: int | None = None,
    use_kernels: bool = True,
) -> mx.array:
    """Paged attention on the best path for this backend (see module docstring).

    Decode (one query per sequence) runs the Metal or CUDA kernel where MLX has
    that backend and `decode_route` picks it, plain or quantized
    (`QuantizedBlocks`) pools alike, unless `use_kernels` is False,
    `KVCHAT_KERNELS=0` or the kernel failed before; on the CPU backend decode and
    prefill go to kvchat's C++ extension where it routes them (`cpu_attention`);
    GPU prefill and shapes the kernels decline use the reference.
    """
    if use_kernels and kernels.kernel_available() is None:  # CPU: kvchat's C++ extension
        out = cpu_attention(queries, k_pool, v_pool, block_tables, context_lens, scale,
                            block_run=block_run)
        if out is not None:
            return out
    if use_kernels and queries.shape[2] == 1:
        route = decode_route(queries.shape[0], block_run, max(int(n) for n in context_lens))
        if route.path in KERNEL_PATHS:
            out = kernel_decode(queries, k_pool, v_pool, block_tables, context_lens, scale,
                                route.path)
            if out is not None:
                return out
    return paged_attention_ref(queries, k_pool, v_pool, block_tables, context_lens, scale,
                               block_run=block_run)
