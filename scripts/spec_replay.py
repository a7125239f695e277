"""Replay prompt lookup over `kvchat bench spec`'s document answers: the engine's policy
against an oracle, at a fixed cost per verified draft.

    .venv/bin/python scripts/spec_replay.py [--draft-cost 0.17] [--answers FILE]

1. Greedy answers of the bench's 10 document questions by the plain engine (saved to
   --answers, reused when it exists).
2. The engine's `Speculator` replayed over them step by step, as the engine runs it (and
   without its draft classes, `engine.token_classes`, for comparison): the
   first answer token comes from the prefill (no drafts there, as in the engine; it is not
   counted, as the bench's decode figures leave it out), drafts are verified against the greedy
   tokens, acceptance is fed back; a step costs 1 + draft cost x drafts verified.
3. Oracles with the same cost: each step drafts exactly the tokens that will be accepted,
   from the latest occurrence of the longest suffix (what lookup proposes), or from the
   best occurrence of any suffix length (what any n-gram lookup could).

Ratios are tokens per unit cost against plain decoding (one unit a token): what lookup
can gain at this cost per draft, and how much of it the policy gets. With the first token
counted as a decode step, the replay reproduced the engine's counts at a fixed cost (162
decode steps, 116 of ~235 drafts accepted, against the engine's 162 and 116 / 234); the
real engine's costs are measured and noisy.
"""

from __future__ import annotations

import argparse
import json
import os

import engine  # noqa: F401  (OpenBLAS before mlx.core)
from engine.pacing import StepPacer
from engine.spec_cost import SpecCost
from engine.speculation import SpecConfig, Speculator
from engine.token_classes import TokenClasses, in_context


def answers(path: str) -> list[tuple[list[int], list[int]]]:
    if os.path.exists(path):
        with open(path) as f:
            return [tuple(x) for x in json.load(f)]
    from app.bench.speculate import questions
    from app.engine_args import load_engine
    from engine import EngineConfig, SamplingParams

    plain = load_engine(None, config=EngineConfig(prefix_cache=False, speculate="off"))
    try:
        data = [(list(map(int, ids)), list(map(int, plain.generate_text(
            ids, SamplingParams(max_tokens=64)).tokens)))
            for ids in (plain.encode_prompt(q) for q in questions(plain.count_tokens))]
    finally:
        plain.shutdown()
    with open(path, "w") as f:
        json.dump(data, f)
    return data


def token_classes() -> TokenClasses:
    """The draft classes the engine builds from the default model's tokenizer."""
    from transformers import AutoTokenizer

    from engine.model.gguf import converted_dir
    from engine.model.loader import default_gguf_path

    return TokenClasses(in_context(AutoTokenizer.from_pretrained(
        converted_dir(default_gguf_path()))))


def policy(data, cost: float, max_new: int = 64,
           classes: TokenClasses | None = None) -> tuple[float, int, int, int]:
    """(ratio, steps, drafts verified, accepted) of the engine's speculator."""
    sp = Speculator(SpecConfig("lookup"), SpecCost(StepPacer(4)), classes=classes)
    sp.cost.warmup = 0
    sp.cost.observe(1, 0, 1.0)
    sp.cost.observe(1, 1, 1.0 + cost)
    units = tokens = steps = verified = accepted = 0
    for seq, (prompt, answer) in enumerate(data):
        ids, i = list(prompt) + answer[:1], 1
        while i < len(answer):
            draft = sp.plan([(seq, ids, max_new - i - 1)]).get(seq, [])
            a = 0
            while a < len(draft) and i + a < len(answer) and draft[a] == answer[i + a]:
                a += 1
            sp.judge(seq, draft, a, answer[i + a] if i + a < len(answer) else None)
            n = min(a + 1, len(answer) - i)
            ids += answer[i:i + n]
            i += n
            units += 1 + cost * len(draft)
            steps, verified, accepted = steps + 1, verified + len(draft), accepted + a
        tokens += len(answer) - 1
        sp.forget(seq)
    return tokens / units, steps, verified, accepted


def oracle(data, cost: float, any_occurrence: bool, max_n: int = 4) -> float:
    units = tokens = 0
    for prompt, answer in data:
        ids, i = list(prompt) + answer[:1], 1
        while i < len(answer):
            best, L = 0, len(ids)
            for n in range(min(max_n, L), 0, -1):
                suffix = ids[L - n:]
                ends = [e for e in range(n - 1, L - 1) if ids[e - n + 1:e + 1] == suffix]
                for e in (ends if any_occurrence else ends[-1:]):
                    a = 0
                    while (e + 1 + a < L and i + a < len(answer)
                           and ids[e + 1 + a] == answer[i + a]):
                        a += 1
                    best = max(best, a)
                if ends and not any_occurrence:
                    break
            n_out = min(best + 1, len(answer) - i)
            ids += answer[i:i + n_out]
            i += n_out
            units += 1 + cost * best
        tokens += len(answer) - 1
    return tokens / units


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--draft-cost", type=float, default=0.17,
                   help="a verified draft's cost, in plain decode steps (0.17 measured here)")
    p.add_argument("--answers", default="spec_answers.json",
                   help="the greedy answers (made on the first run)")
    args = p.parse_args()
    data = answers(args.answers)
    c = args.draft_cost
    print(f"{len(data)} answers, {sum(len(a) for _, a in data)} tokens; a draft costs {c} of "
          f"a step")
    for name, classes in (("engine policy", token_classes()), ("without draft classes", None)):
        ratio, steps, verified, accepted = policy(data, c, classes=classes)
        print(f"{name}: {ratio:.3f}x ({steps} decode steps, {accepted} of {verified} "
              f"drafts accepted)")
    print(f"oracle, latest occurrence: {oracle(data, c, False):.3f}x; any occurrence: "
          f"{oracle(data, c, True):.3f}x")


if __name__ == "__main__":
    main()
