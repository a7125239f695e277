"""CPU paged attention through the extension: routing, first-launch check, fallback.

`cpu_attention` is the hook `paged_attention` calls on the CPU backend, for decode and
prefill alike. It returns None ("use the reference") unless the extension builds here
(the first call builds it when the loader has not; the same on every path, so routing
never depends on what else the process loaded), the route table picks it, and the shapes
fit. Each variant's first launch is checked against `paged_attention_ref`; any exception or
mismatch drops the extension's attention for the rest of the process, said once.
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Sequence

import mlx.core as mx

from engine.kvcache.kv_cache import QuantizedBlocks
from engine.model import kernels
from engine.model.cpu_ext import build, ops

_log = logging.getLogger("kvchat.cpu_ext")
_state_lock = threading.Lock()
_fallback: str | None = None
_validated: set[tuple] = set()


# CPU decode routes, measured on the 2-core x86_64 build VM (Hq 9, Hkv 3, D 64, blocks of
# 16; us per call, best of 3; scripts/bench_cpu_ext.py --only attention):
#
#   pools    context            reference                 extension
#   float16  1 x 128            183 (view of the run)     107
#   float16  1 x 1024           764 (view of the run)     167
#   float16  1 x 4096          2926 (view of the run)     706
#   float32  1 x 128             64 (view of the run)      34
#   float32  1 x 1024           262 (view of the run)     172
#   float32  1 x 4096          1007 (view of the run)     472
#   float16  4 ragged (50-1000) 2477 (gather + mask)      351
#   float16  8 x 1024          6773 (gather + mask)      1186
#
# The extension wins every row (one op instead of the reference's ~15, no gather copy,
# no astype copy of a float16 pool, no padding of ragged batches), so it takes every
# decode but one: a single sequence whose pools are plain and of the queries' dtype
# keeps the reference, because that is exactly the computation mlx-lm does over its
# dense cache, and `--weights float32` promises mlx-lm's greedy tokens exactly
# (tests/test_engine_parity.py). The extension path keeps K/V in float16, so its
# single sequences do take the extension.


# Prefill (a chunk of L causal queries; float32 queries, float16 pools, one contiguous
# run; ms per call, best of 5, 2 threads, load ~3): the reference casts the run to
# float32 and runs MLX's CPU SDPA, which builds the L x T scores and mask; the extension
# tiles it flash-style and never holds an L x T array.
#
#   chunk x context    reference    extension
#   512 x 512              62.4         2.6
#   512 x 1024            127.1         7.2
#   512 x 4096            546.2        35.6
#
# The parity rule above holds for prefill too (same `route`).


def route(batch: int, block_run: int | None, queries: mx.array, k_pool, v_pool) -> str:
    """"kernel" or "reference" for one attention call (the tables above).

    ``block_run`` (a contiguous run) does not change the answer: the reference's view
    of the run is still slower than the kernel, and it is the parity rule that keeps
    single float sequences on the reference.
    """
    plain = not isinstance(k_pool, QuantizedBlocks) and not isinstance(v_pool, QuantizedBlocks)
    same_dtype = plain and k_pool.dtype == queries.dtype and v_pool.dtype == queries.dtype
    if batch == 1 and same_dtype:
        return "reference"
    return "kernel"


def fallback_reason() -> str | None:
    """Why the extension's attention was dropped for this process; None while it is not."""
    return _fallback


def reset() -> None:
    """Forget a fallback and the validated variants (tests)."""
    global _fallback
    with _state_lock:
        _fallback = None
        _validated.clear()


def _fall_back(reason: str) -> None:
    global _fallback
    with _state_lock:
        if _fallback is not None:
            return
        _fallback = reason
    message = f"kvchat: CPU paged attention off for this process, using the reference: {reason}"
    _log.info(message)  # the warning below is the one line users see
    # One line on stderr (no source line under it): the message says everything.
    warnings.warn_explicit(message, RuntimeWarning, "kvchat", 0)


def _variant(queries: mx.array, pool) -> tuple:
    if isinstance(pool, QuantizedBlocks):
        return ("q", pool.quant.bits, pool.quant.group_size, pool.scales.dtype)
    return ("f", pool.dtype)


def _check_first_launch(out, queries, k_pool, v_pool, block_tables, context_lens, scale):
    """Raise `KernelMismatch` unless ``out`` matches the reference.

    The allowance is the queries' dtype's, or float16's when a pool is stored in less
    than float32: the reference rounds dequantized (or half) rows to the pool's float16,
    the kernel does not.
    """
    from engine.model.paged_attention import (
        FIRST_LAUNCH_TOLERANCE,
        KernelMismatch,
        paged_attention_ref,
    )

    ref = paged_attention_ref(queries, k_pool, v_pool, block_tables, context_lens, scale)
    mx.eval(out, ref)
    tolerance = FIRST_LAUNCH_TOLERANCE[ref.dtype]
    if any(p.dtype != mx.float32 for p in (k_pool, v_pool)):
        tolerance = max(tolerance, FIRST_LAUNCH_TOLERANCE[mx.float16])
    err = mx.abs(out.astype(mx.float32) - ref.astype(mx.float32)).max().item()
    bound = tolerance * max(1.0, mx.abs(ref).max().item())
    if not err <= bound:  # NaN fails too
        raise KernelMismatch(f"first launch differs from the reference by {err:.3g} "
                             f"(allowed {bound:.3g})")


def cpu_attention(queries: mx.array, k_pool, v_pool, block_tables: mx.array,
                  context_lens: Sequence[int], scale: float, *,
                  block_run: int | None = None) -> mx.array | None:
    """Paged attention on the extension (decode when L == 1, else causal prefill), or
    None when the reference should run.

    ``KVCHAT_KERNELS=0`` (the switch of the GPU kernels) keeps CPU attention on the
    reference too; ``KVCHAT_CPU_EXT=0`` turns the whole extension off.
    """
    if _fallback is not None or not kernels.kernels_enabled() or build.load() is None:
        return None
    if not ops.supports(queries, k_pool, v_pool):
        return None
    if route(queries.shape[0], block_run, queries, k_pool, v_pool) != "kernel":
        return None
    prefill = queries.shape[2] > 1
    key = (prefill, queries.dtype, queries.shape[1] // k_pool.shape[0], queries.shape[3],
           k_pool.shape[2], _variant(queries, k_pool), _variant(queries, v_pool))
    run = ops.paged_prefill if prefill else ops.paged_decode
    try:
        out = run(queries, k_pool, v_pool, block_tables, context_lens, scale)
        if key not in _validated:
            _check_first_launch(out, queries, k_pool, v_pool, block_tables, context_lens, scale)
            with _state_lock:
                _validated.add(key)
    except Exception as exc:  # noqa: BLE001 - any failure means: the reference from now on
        _fall_back(f"{type(exc).__name__}: {exc}")
        return None
    return out
