"""Micro-benchmark: paged decode kernel vs gather + SDPA (the reference path).

Runs only where Metal (or CUDA) is available:
    python -m tests.kernel_harness.bench_metal [--dtype float16] [--iters 50]
Prints one row per shape: milliseconds per call for both paths and the ratio.
"""

from __future__ import annotations

import argparse
import sys
import time

# engine first: it preloads OpenBLAS before anything imports mlx.core on Linux.
from engine.model import kernels
from engine.model.paged_attention import paged_attention_ref

from .cases import Case, make_inputs

# (batch, context) pairs at Llama-3-8B-like heads: 32 q heads, 8 kv heads, D=128.
SHAPES = [(1, 512), (1, 4096), (1, 16384), (4, 1024), (8, 4096), (16, 2048)]


def time_call(fn, inputs: dict, iters: int) -> float:
    import mlx.core as mx

    for _ in range(3):
        mx.eval(fn(**inputs))
    start = time.perf_counter()
    for _ in range(iters):
        mx.eval(fn(**inputs))
    return (time.perf_counter() - start) / iters * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args(argv)
    backend = kernels.kernel_available()
    if backend is None:
        print("no Metal/CUDA back-end: nothing to benchmark", file=sys.stderr)
        return 1
    print(f"backend={backend} dtype={args.dtype} block_size={args.block_size}")
    print(f"{'batch':>5} {'context':>7} {'kernel ms':>10} {'gather+sdpa ms':>15} {'speedup':>8}")
    for batch, context in SHAPES:
        lens = tuple(max(1, context - 7 * i) for i in range(batch))  # slightly ragged
        case = Case(args.dtype, 128, args.block_size, 32, 8, lens, seed=batch)
        inputs = make_inputs(case)
        t_kernel = time_call(kernels.paged_decode_attention, inputs, args.iters)
        t_ref = time_call(paged_attention_ref, inputs, args.iters)
        print(f"{batch:5d} {context:7d} {t_kernel:10.3f} {t_ref:15.3f} {t_ref / t_kernel:8.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
