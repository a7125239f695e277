"""What prompt lookup's decode steps cost in the engine, by drafts verified, against plain
decoding's steps on the same answers (`kvchat bench spec`'s document questions).

    .venv/bin/python scripts/spec_step_costs.py [--rounds 2]

Two engines over one loaded model, no prefix cache, each answer in one mode then the
other. For lookup, every decode step the engine's own cost model times (`SpecCost`: from a
step's start to the next one's, so the work between steps counts) is grouped by the drafts
it verified; plain decoding's cost is its decode seconds per token. Printed per document
size: plain ms/token, lookup's draft-free steps (what a step without drafts costs a
speculating engine: it reads each step's token before planning the next), and each draft
count's median step with its extra over a draft-free step, in plain steps.
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict

import engine  # noqa: F401  (OpenBLAS before mlx.core)
import engine.spec_cost as spec_cost


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2, help="rounds over the 10 answers (2)")
    args = p.parse_args()
    from app.bench.speculate import _alone, questions
    from app.engine_args import load_engine
    from engine import Engine, EngineConfig

    steps: list[tuple[int, float]] = []  # (drafts, seconds) of the lookup engine's steps
    observe = spec_cost.SpecCost.observe

    def timed(self, rows: int, drafts: int, seconds: float) -> None:
        steps.append((drafts, seconds))
        observe(self, rows, drafts, seconds)

    spec_cost.SpecCost.observe = timed
    plain = load_engine(None, config=EngineConfig(prefix_cache=False, speculate="off"))
    spec = Engine(plain.loaded, EngineConfig(prefix_cache=False, speculate="lookup"))
    prompts = [plain.encode_prompt(q) for q in questions(plain.count_tokens)]
    plain_tok: dict[str, list[tuple[int, float]]] = defaultdict(list)
    by_drafts: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    try:
        for _ in range(args.rounds):
            for i, ids in enumerate(prompts):
                size = "1k" if i < len(prompts) // 2 else "2k"  # the bench's first five: 1k
                _, tok, sec, _ = _alone(plain, [ids], 64)
                plain_tok[size].append((tok, sec))
                steps.clear()
                _alone(spec, [ids], 64)
                for drafts, seconds in steps:
                    by_drafts[size][drafts].append(seconds)
    finally:
        plain.shutdown()
        spec.shutdown()
    for size in sorted(plain_tok):
        tok, sec = map(sum, zip(*plain_tok[size], strict=True))
        plain_s = sec / tok
        base = statistics.median(by_drafts[size][0])
        print(f"{size} documents: plain {plain_s * 1e3:.2f} ms/token; lookup's draft-free "
              f"steps {base * 1e3:.2f} ms ({base / plain_s:.2f}x plain)")
        for k, v in sorted(by_drafts[size].items()):
            if k:
                med = statistics.median(v)
                extra = (med - base) / plain_s  # noise can make it negative
                print(f"  {k} drafts: {len(v):3d} steps, median {med * 1e3:.2f} ms, "
                      f"{extra:+.2f} plain steps ({extra / k:+.3f} a draft)")


if __name__ == "__main__":
    main()
