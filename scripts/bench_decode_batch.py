"""Aggregate decode throughput of B streams all decoding vs one stream (no prefill mixed in).

    .venv/bin/python scripts/bench_decode_batch.py [--context-repeat 1] [--batch 8]

Run twice with KVCHAT_SPLIT_GEMM=0 / 1 to see the GEMV shim's small-M split.
"""

from __future__ import annotations

import argparse
import time

import engine  # noqa: F401  (OpenBLAS preload first)
from engine import Engine, EngineConfig, SamplingParams, load_model


def aggregate(eng: Engine, prompts: list[list[int]], gen: int) -> tuple[float, float]:
    """(tok/s over all streams, ms per step) while every stream is decoding."""
    handles = [eng.submit(p, SamplingParams(max_tokens=gen, ignore_eos=True)) for p in prompts]
    reqs = [h._request for h in handles]
    while any(r.stats.generation_tokens == 0 for r in reqs):
        eng.step()
    start, before, steps = time.perf_counter(), sum(r.stats.generation_tokens for r in reqs), 0
    while not any(r.finished for r in reqs):
        eng.step()
        steps += 1
    dt = time.perf_counter() - start
    toks = sum(r.stats.generation_tokens for r in reqs) - before
    for h in handles:
        list(h)
    return toks / dt, dt / steps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context-repeat", type=int, default=1, help="prompt length multiplier")
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    eng = Engine(load_model(), EngineConfig(kv_budget_bytes=512 << 20))
    prompts = [eng.encode_prompt(f"Tell me story number {i} about a cat and a dog. "
                                 * args.context_repeat) for i in range(args.batch)]
    print(f"context ~{len(prompts[0])} tokens")
    single, batched = [], []
    for _ in range(args.rounds):
        single.append(aggregate(eng, prompts[:1], args.gen))
        batched.append(aggregate(eng, prompts, args.gen))
    s = max(t for t, _ in single)
    b = max(t for t, _ in batched)
    print(f"1 stream: {s:.1f} tok/s ({min(m for _, m in single):.0f} ms/step); "
          f"{args.batch} streams: {b:.1f} tok/s ({min(m for _, m in batched):.0f} ms/step); "
          f"ratio {b / s:.2f}x (best of {args.rounds})")


if __name__ == "__main__":
    main()
