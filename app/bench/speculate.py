"""`kvchat bench spec`: speculative decoding (prompt lookup) vs plain, side by side.

The prompts are document Q&A: `kvchat eval ask`'s generated documents (1k and 2k tokens,
facts at chosen depths) with five questions each: each of its two facts, the sentence
that states it quoted word for word, and a summary of the text's opening. Every answer is
greedy, so both modes must give the same tokens (counted and printed). Two engines over
one loaded model, no prefix cache (nothing one run computed serves the other), run the
same prompts in alternation, round after round:
- one stream: each question alone, in one mode then the other (so a change in the
  machine's load hits both alike); decode tok/s = tokens after the first / seconds from
  the first token to the last, summed over the answers (prefill apart), and the median of
  the answers' own lookup / plain ratios;
- N streams: N questions submitted at once to a fresh engine of each mode whose prefix
  cache (RAM) first took the N prompts (one token each): their prefills are then a block
  or so, and the tokens decoded after every prompt's first token, over the seconds from
  then to the last token, are nearly all of them (without the warm cache, the short
  answers ended during the long prompts' prefills: 14-30 of ~166 tokens were counted).

Lookup / plain is given three ways: the best round of each mode, the median over rounds
of each round's paired ratio (the same answers' decode seconds, summed, run in turn), and
the median of the answers' own ratios.
"""

from __future__ import annotations

import json
import statistics

from app import arg_types
from app.bench.common import log, machine_info
from app.engine_args import add_engine_args, load_engine
from app.engine_config import config_from_args

SIZES = (1024, 2048)


def add_parser(sub) -> None:
    """Register ``spec`` on the subparsers of the ``bench`` command."""
    p = sub.add_parser("spec", help="speculative decoding (lookup) vs plain decoding",
                       description=__doc__.splitlines()[0])
    add_engine_args(p, disk=False)
    p.add_argument("--gen", type=arg_types.int_in(2), default=64,
                   help="most tokens per answer (64)")
    p.add_argument("--streams", type=arg_types.int_in(2), default=8,
                   help="streams of the batched round (8)")
    p.add_argument("--rounds", type=arg_types.positive_int, default=2,
                   help="rounds; the best of each mode is reported (2)")
    p.add_argument("--quick", action="store_true",
                   help="two questions on a 384-token document (a smoke run)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=run)


def questions(count_tokens, sizes=SIZES) -> list[str]:
    """Document Q&A prompts (eval ask's generated documents, five questions each)."""
    from app.eval.probes import haystack, pick_needles

    prompts = []
    for i, size in enumerate(sizes):
        needles = pick_needles(800 + i, 2)
        text, _ = haystack(800 + i, needles, size, count_tokens, overhead=64)
        for n in needles:
            prompts += [f"{text}\n\nQuestion: {n.question} Answer with the number from the text.",
                        f"{text}\n\nQuote, word for word, the sentence of the text that gives "
                        f"the {n.key}."]
        prompts.append(f"{text}\n\nSummarize the first three sentences of the text.")
    return prompts


def _alone(eng, prompts, gen) -> tuple[list[list[int]], int, float, int]:
    """(tokens per answer, decode tokens, decode seconds, steps) of each prompt alone."""
    from engine import SamplingParams

    outs, tokens, seconds = [], 0, 0.0
    steps = eng.metrics().steps
    for ids in prompts:
        r = eng.generate_text(ids, SamplingParams(max_tokens=gen))
        outs.append(r.tokens)
        tokens += max(r.stats.generation_tokens - 1, 0)
        seconds += r.stats.decode_s
    return outs, tokens, seconds, eng.metrics().steps - steps


def _together(eng, prompts, gen) -> tuple[list[list[int]], int, float]:
    """(tokens per answer, tokens decoded, seconds) of all at once, timed from the step in
    which the last prompt's prefill ended (so prefill is left out) to the last token."""
    import time

    from engine import SamplingParams

    handles = [eng.submit(ids, SamplingParams(max_tokens=gen)) for ids in prompts]
    outs: list[list[int]] = [[] for _ in handles]
    done = [False] * len(handles)

    def drain() -> None:
        for i, h in enumerate(handles):
            while (e := h.poll()) is not None:
                outs[i] += [e.token] if e.token is not None else []
                done[i] = done[i] or e.finish_reason is not None

    while not all(o or d for o, d in zip(outs, done, strict=True)):
        eng.step()
        drain()
    start, before = time.perf_counter(), sum(map(len, outs))
    while not all(done):
        eng.step()
        drain()
    return outs, sum(map(len, outs)) - before, time.perf_counter() - start


def _warm_streams(loaded, args, mode: str, batch, gen) -> tuple[list[list[int]], int, float]:
    """`_together` on a fresh engine of ``mode`` whose prefix cache took the prompts first."""
    from engine import Engine, SamplingParams

    eng = Engine(loaded, config_from_args(args, prefix_cache=True, speculate=mode))
    try:
        for ids in {tuple(ids): ids for ids in batch}.values():
            eng.generate_text(ids, SamplingParams(max_tokens=1))
        return _together(eng, batch, gen)
    finally:
        eng.shutdown()


def run(args) -> int:
    from engine import Engine

    log("spec", "loading the model")
    plain = load_engine(args.model, weights=args.weights,
                        config=config_from_args(args, prefix_cache=False, speculate="off"))
    spec = Engine(plain.loaded, config_from_args(args, prefix_cache=False, speculate="lookup"))
    texts = questions(plain.count_tokens, (384,)) if args.quick else questions(
        plain.count_tokens)
    prompts = [plain.encode_prompt(q) for q in texts[:2 if args.quick else None]]
    batch = (prompts * args.streams)[:args.streams]
    engines = (("plain", plain), ("lookup", spec))
    best: dict[str, dict] = {}
    same = {"alone": True, "streams": True}
    ratios: list[float] = []  # lookup / plain decode tok/s of each answer, each round
    paired: list[float] = []  # each round's plain / lookup decode seconds, same answers
    try:
        for i in range(args.rounds):
            log("spec", f"round {i + 1}/{args.rounds}: {len(prompts)} answers alone, "
                        f"{args.streams} together, each mode")
            m0 = {name: eng.metrics() for name, eng in engines}
            rows = {name: {"outs": [], "tok": 0, "sec": 0.0, "steps": 0} for name, _ in engines}
            for ids in prompts:  # each answer in both modes in turn: load hits both alike
                tps = {}
                for name, eng in engines:
                    outs, tok, sec, steps = _alone(eng, [ids], args.gen)
                    r = rows[name]
                    r["outs"] += outs
                    r["tok"], r["sec"], r["steps"] = r["tok"] + tok, r["sec"] + sec, \
                        r["steps"] + steps
                    tps[name] = tok / sec if sec else 0.0
                if tps["plain"] > 0 and tps["lookup"] > 0:
                    ratios.append(tps["lookup"] / tps["plain"])
            if rows["lookup"]["sec"] > 0:
                paired.append(rows["plain"]["sec"] / rows["lookup"]["sec"])
            together = {name: _warm_streams(plain.loaded, args, mode, batch, args.gen)
                        for name, mode in (("plain", "off"), ("lookup", "lookup"))}
            same["alone"] &= rows["plain"]["outs"] == rows["lookup"]["outs"]
            same["streams"] &= together["plain"][0] == together["lookup"][0]
            for name, eng in engines:
                r, (_, btok, bsec), m1 = rows[name], together[name], eng.metrics()
                row = {"alone_tps": r["tok"] / r["sec"] if r["sec"] else 0.0,
                       "alone_tokens": r["tok"], "alone_steps": r["steps"],
                       "streams_tps": btok / bsec if bsec else 0.0, "streams_tokens": btok,
                       "proposed": m1.spec_proposed - m0[name].spec_proposed,
                       "accepted": m1.spec_accepted - m0[name].spec_accepted}
                old = best.get(name)
                best[name] = row if old is None else {
                    **(row if row["alone_tps"] > old["alone_tps"] else old),
                    **{k: (row if row["streams_tps"] > old["streams_tps"] else old)[k]
                       for k in ("streams_tps", "streams_tokens")}}
    finally:
        plain.shutdown()
        spec.shutdown()
    result = {"machine": machine_info(), "answers": len(prompts), "streams": args.streams,
              "gen": args.gen, "rounds": args.rounds, "modes": best,
              "ratio_alone": best["lookup"]["alone_tps"] / max(best["plain"]["alone_tps"], 1e-9),
              "ratio_streams": (best["lookup"]["streams_tps"]
                                / max(best["plain"]["streams_tps"], 1e-9)),
              "median_answer_ratio": statistics.median(ratios) if ratios else None,
              "median_round_ratio": statistics.median(paired) if paired else None,
              "same_tokens": same}
    print(json.dumps(result, indent=2) if args.json else report(result))
    return 0 if all(same.values()) else 1


def report(r: dict) -> str:
    lines = [f"{r['answers']} document answers (up to {r['gen']} tokens, greedy), best of "
             f"{r['rounds']} rounds; no prefix cache alone, a warm one for the streams",
             "| mode | decode tok/s alone | steps alone | decode tok/s, "
             f"{r['streams']} streams (tokens timed) | drafts accepted / verified alone |",
             "|---|---:|---:|---:|---:|"]
    for name, m in r["modes"].items():
        lines.append(f"| {name} | {m['alone_tps']:.1f} | {m['alone_steps']} | "
                     f"{m['streams_tps']:.1f} ({m['streams_tokens']}) | "
                     f"{m['accepted']} / {m['proposed']} |")
    med, rnd = r["median_answer_ratio"], r["median_round_ratio"]
    lines.append(f"median of the answers' own ratios: {med:.2f}x" if med else "")
    lines.append(f"median of the rounds' paired ratios: {rnd:.2f}x" if rnd else "")
    lines.append(f"lookup / plain: {r['ratio_alone']:.2f}x alone, {r['ratio_streams']:.2f}x at "
                 f"{r['streams']} streams; same tokens: alone {r['same_tokens']['alone']}, "
                 f"streams {r['same_tokens']['streams']}")
    return "\n".join(lines)
