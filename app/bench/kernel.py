"""`kvchat bench kernel`: the paged decode kernel vs gather + SDPA (the reference path).

Runs only where MLX can run custom kernels (Metal, or CUDA); elsewhere it stops with
one line. Prints one row per shape: milliseconds per call for both paths and the ratio.
"""

from __future__ import annotations

import math
import time

from app import arg_types
from engine.errors import KVChatError

# (batch, context) pairs at Llama-3-8B-like heads: 32 q heads, 8 kv heads, D=128.
SHAPES = [(1, 512), (1, 4096), (1, 16384), (4, 1024), (8, 4096), (16, 2048)]
NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128


def add_parser(sub) -> None:
    """Register ``kernel`` on the subparsers of the ``bench`` command."""
    p = sub.add_parser("kernel", help="paged decode kernel vs gather + SDPA (Metal/CUDA only)",
                       description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    p.add_argument("--block-size", type=arg_types.block_size, default=16)
    p.add_argument("--iters", type=arg_types.positive_int, default=50)
    p.set_defaults(func=run)


def make_inputs(batch: int, context: int, dtype: str, block_size: int, seed: int) -> dict:
    """Random queries and pools; each sequence's blocks scattered over the pool."""
    import mlx.core as mx
    import numpy as np

    rng = np.random.default_rng(seed)
    mx.random.seed(seed)
    lens = [max(1, context - 7 * i) for i in range(batch)]  # slightly ragged
    needed = [-(-n // block_size) for n in lens]
    ids = rng.permutation(sum(needed))
    table = np.zeros((batch, max(needed)), dtype=np.int32)
    start = 0
    for b, k in enumerate(needed):
        table[b, :k] = ids[start:start + k]
        start += k
    dt = getattr(mx, dtype)
    pool = (NUM_KV_HEADS, sum(needed), block_size, HEAD_DIM)
    return {
        "queries": mx.random.normal((batch, NUM_Q_HEADS, 1, HEAD_DIM)).astype(dt),
        "k_pool": mx.random.normal(pool).astype(dt),
        "v_pool": mx.random.normal(pool).astype(dt),
        "block_tables": mx.array(table),
        "context_lens": lens,
        "scale": 1.0 / math.sqrt(HEAD_DIM),
    }


def time_call(fn, inputs: dict, iters: int) -> float:
    """Milliseconds per call after three warm-up calls."""
    import mlx.core as mx

    for _ in range(3):
        mx.eval(fn(**inputs))
    start = time.perf_counter()
    for _ in range(iters):
        mx.eval(fn(**inputs))
    return (time.perf_counter() - start) / iters * 1e3


def run(args) -> int:
    """Print the table; a clear error where no custom-kernel back-end exists."""
    from engine.model import kernels
    from engine.model.paged_attention import paged_attention_ref

    backend = kernels.kernel_available()
    if backend is None:
        raise KVChatError("bench kernel needs Metal or CUDA: this MLX build runs custom "
                          "kernels on neither (the CPU uses the reference path only)")
    print(f"backend={backend} dtype={args.dtype} block_size={args.block_size}")
    print(f"{'batch':>5} {'context':>7} {'kernel ms':>10} {'gather+sdpa ms':>15} {'speedup':>8}")
    for batch, context in SHAPES:
        inputs = make_inputs(batch, context, args.dtype, args.block_size, seed=batch)
        t_kernel = time_call(kernels.paged_decode_attention, inputs, args.iters)
        t_ref = time_call(paged_attention_ref, inputs, args.iters)
        print(f"{batch:5d} {context:7d} {t_kernel:10.3f} {t_ref:15.3f} {t_ref / t_kernel:8.2f}x")
    return 0
