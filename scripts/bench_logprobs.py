"""Batch decode tok/s with and without logprobs, interleaved A/B on one engine.

Modes, each run in turn every round (so load changes hit them alike):
  base  requests without logprobs, `engine.logprobs.attach` replaced by a no-op: the code
        path as it was before logprobs existed
  off   requests without logprobs, the code as it is (must equal base)
  on    every request asks for logprobs with 5 alternatives
Prints the median decode tok/s of each mode over the rounds, the ratios of the medians and
the median of each round's own off/base ratio.

    python scripts/bench_logprobs.py --batch 8 --tokens 64 --rounds 6
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import engine  # noqa: F401  (OpenBLAS before mlx)
from engine import Engine, EngineConfig, SamplingParams, load_model, logprobs
from engine import executor as executor_mod

PROMPTS = ["Write a story about a lighthouse.", "Explain how a bicycle works.",
           "List the planets and one fact each.", "Describe a market in the morning.",
           "Give advice to a new gardener.", "Tell me about the history of tea.",
           "How do bees make honey?", "What makes a good friend?"]


def run(eng: Engine, batch: int, tokens: int, k: int | None) -> float:
    """Decode tok/s of one batch: tokens after each request's first, over the time from
    the first first token to the last token (prefill mostly served from the prefix cache)."""
    ids = [eng.encode_prompt(PROMPTS[i % len(PROMPTS)]) for i in range(batch)]
    t0 = time.perf_counter()
    handles = [eng.submit(i, SamplingParams(max_tokens=tokens, ignore_eos=True, logprobs=k))
               for i in ids]
    results = [list(h) for h in handles]
    end = time.perf_counter()
    stats = [r[-1].stats for r in results]
    first = t0 + min(s.ttft_s for s in stats)
    return sum(s.generation_tokens - 1 for s in stats) / (end - first)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    eng = Engine(load_model(), EngineConfig(kv_budget_bytes=256 << 20))
    eng.start()
    real = logprobs.attach
    modes = {"base": (None, lambda outcomes, *a: outcomes), "off": (None, real),
             "on": (5, real)}
    run(eng, args.batch, 8, None)  # warm-up
    seen: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(args.rounds):
        order = list(modes) if r % 2 == 0 else list(modes)[::-1]
        for m in order:
            k, attach = modes[m]
            executor_mod.logprobs.attach = attach
            seen[m].append(run(eng, args.batch, args.tokens, k))
    executor_mod.logprobs.attach = real
    eng.shutdown()
    med = {m: statistics.median(v) for m, v in seen.items()}
    print(f"load average at the end: {os.getloadavg()[0]:.2f} (2 cores)")
    for m, v in seen.items():
        print(f"{m:5s} median {med[m]:6.1f} tok/s  runs " + " ".join(f"{x:.1f}" for x in v))
    print(f"off/base {med['off'] / med['base']:.3f}   on/off {med['on'] / med['off']:.3f}")
    paired = [o / b for o, b in zip(seen["off"], seen["base"], strict=True)]
    print(f"median of each round's off/base: {statistics.median(paired):.3f}")


if __name__ == "__main__":
    main()
