"""`kvchat bench decode`: aggregate decode tok/s of B streams decoding together vs one.

Each round submits the same prompts (1, then B at once), greedy with EOS ignored, and
reads the engine's decode-forward clock (`EngineMetrics.decode_forward`): the time in
batched decode forwards alone, so prefill never mixes into the rate. Run it twice with
KVCHAT_SPLIT_GEMM=0 / 1 to see the GEMV shim's small-M split. ``--json-schema FILE``
runs every round twice more, each stream held to the schema (constrained decoding), and
prints the constrained rates beside the free ones, with their ratio; and once more with
every other stream held to it, for what constrained requests cost their free neighbours
(in a batch every stream waits for the same steps: the free streams' rate is 1 / step).
"""

from __future__ import annotations

import argparse

from app import arg_types
from app.bench.common import log
from app.engine_args import add_engine_args, build_engine


def add_parser(sub) -> None:
    """Register ``decode`` on the subparsers of the ``bench`` command."""
    p = sub.add_parser("decode", help="aggregate decode tok/s: B streams vs one",
                       description=__doc__.splitlines()[0])
    add_engine_args(p, disk=False)
    p.add_argument("--batch", type=arg_types.int_in(2), default=8, help="streams (8)")
    p.add_argument("--context-repeat", type=arg_types.positive_int, default=1,
                   help="prompt length multiplier (1)")
    p.add_argument("--gen", type=arg_types.int_in(2), default=32,
                   help="tokens decoded per stream (32)")
    p.add_argument("--rounds", type=arg_types.positive_int, default=2,
                   help="rounds; the best is reported (2)")
    p.add_argument("--json-schema", default=None, metavar="FILE",
                   help="also decode held to this JSON schema, and compare")
    p.set_defaults(func=run)


def aggregate(eng, prompts: list[list[int]], gen: int, constraint=None
              ) -> tuple[float, float, float]:
    """(decode tok/s over all streams, ms per decode step, mean streams per step)."""
    from engine import SamplingParams

    before = eng.metrics().decode_forward
    each = constraint if isinstance(constraint, list) else [constraint] * len(prompts)
    handles = [eng.submit(p, SamplingParams(max_tokens=gen, ignore_eos=True, constraint=c))
               for p, c in zip(prompts, each, strict=True)]
    for h in handles:  # no engine thread: reading the first drives the steps of all
        for _ in h:
            pass
    after = eng.metrics().decode_forward
    steps, tokens = after.steps - before.steps, after.tokens - before.tokens
    seconds = after.seconds - before.seconds
    if steps == 0 or seconds <= 0:
        raise RuntimeError("no decode step was timed")
    return tokens / seconds, seconds / steps * 1e3, tokens / steps


def run(args) -> int:
    """Print one line: 1 stream vs B streams, tok/s and ms per step (best of the rounds)."""
    constraint = None
    if args.json_schema:
        from app.constraint_args import read_constraint

        constraint = read_constraint(argparse.Namespace(
            json_object=False, regex=None, json_schema=args.json_schema, grammar=None))
    log("decode", "loading the model")
    eng = build_engine(args)
    prompts = [eng.encode_prompt(f"Tell me story number {i} about a cat and a dog. "
                                 * args.context_repeat) for i in range(args.batch)]
    print(f"context ~{len(prompts[0])} tokens")
    runs = {"free": (None, [], [])}
    if constraint is not None:
        runs["json-schema"] = (constraint, [], [])
        # every other stream constrained; at 1 stream, the constrained one
        runs["mixed"] = ([constraint, None] * args.batch, [], [])
    try:
        for i in range(args.rounds):
            log("decode", f"round {i + 1}/{args.rounds}")
            for c, single, batched in runs.values():  # interleaved: noise hits both alike
                part = c[:args.batch] if isinstance(c, list) else c
                single.append(aggregate(eng, prompts[:1], args.gen,
                                        part[:1] if isinstance(part, list) else part))
                batched.append(aggregate(eng, prompts, args.gen, part))
    finally:
        eng.shutdown()
    best = {}
    for name, (_, single, batched) in runs.items():
        s, b = max(single), max(batched)
        best[name] = s[0], b[0]
        print(f"{name}: 1 stream: {s[0]:.1f} tok/s ({min(m for _, m, _ in single):.0f} ms/step);"
              f" {args.batch} streams: {b[0]:.1f} tok/s ({min(m for _, m, _ in batched):.0f} "
              f"ms/step, mean batch {b[2]:.1f}); ratio {b[0] / s[0]:.2f}x "
              f"(best of {args.rounds})")
    if "json-schema" in best:
        (f1, f8), (c1, c8) = best["free"], best["json-schema"]
        print(f"json-schema vs free: {c1 / f1:.2f}x at 1 stream, {c8 / f8:.2f}x at "
              f"{args.batch} streams")
        m8 = best["mixed"][1]
        print(f"free neighbours of constrained streams (half of {args.batch} constrained): "
              f"{m8 / f8:.2f}x the all-free rate")
    return 0
