"""`kvchat eval shift`: what a context shift costs, in perplexity of a long stream.

A text of ``--factor`` x ``--context`` tokens (generated local history, `app.eval.docs`, so
nothing is known to the model) is scored teacher-forced through the paged pool as one
sequence that may hold ``--context`` tokens. Whenever it is full, three policies go on:

- ``shift``: kvchat's context shift (`engine.kvcache.context_shift` + `model.rope_shift`,
  the code `--context-shift` runs): sinks and the newest half stay, their K/V as computed,
  the kept keys re-rotated to their new positions;
- ``fresh``: the same kept tokens (sinks + window) prefilled again from scratch at the same
  positions, as a recomputing shift (or a new request over the window) would;
- ``full``: nothing dropped (the whole stream in the model's own context): the floor.

Both shifting policies see the same tokens at the same positions and score identically
until the first shift; the figure is the perplexity of the tokens after it.
"""

from __future__ import annotations

import argparse
import sys
import time

from app.eval import report

POLICIES = ("shift", "fresh", "full")
SEQ_ID = 1 << 41  # away from the engine's request ids


def log(message: str) -> None:
    print(f"[eval shift] {message}", file=sys.stderr, flush=True)


def _batch(engine, piece: list[int]):
    import mlx.core as mx

    from engine.executor import build_batch

    plan = engine.blocks.append(SEQ_ID, len(piece))
    return build_batch(engine.blocks, [SEQ_ID], mx.array([piece], dtype=mx.int32),
                       [plan.slots])


def _prefill(engine, piece: list[int]) -> None:
    import mlx.core as mx

    engine.runner(_batch(engine, piece), engine.kv, logits=False)
    mx.eval(*engine.kv.arrays)


def _score(engine, piece: list[int], targets: list[int], out) -> None:
    """Append ``piece`` to the sequence; add the scores of ``targets`` to ``out``."""
    import mlx.core as mx

    from app.eval.perplexity import all_logits

    logits = all_logits(engine.runner, _batch(engine, piece), engine.kv)[0, : len(targets)]
    logits = logits.astype(mx.float32)
    picked = mx.take_along_axis(logits, mx.array(targets)[:, None], axis=-1)[:, 0]
    nll, top1 = mx.logsumexp(logits, axis=-1) - picked, mx.argmax(logits, axis=-1)
    mx.eval(nll, top1, *engine.kv.arrays)
    out.nll += nll.tolist()
    out.top1 += top1.tolist()


def score_stream(engine, ids: list[int], policy: str, *, context: int, sink_tokens: int,
                 chunk: int = 256):
    """Teacher-forced `TokenScores` of ``ids[1:]`` under ``policy`` (see the module), and
    the positions (indices into the scores) where the sequence was shifted."""
    from app.eval.perplexity import TokenScores
    from engine.kvcache.context_shift import plan_drop, shift
    from engine.model.rope_shift import KeyShifter

    blocks, bs = engine.blocks, engine.blocks.block_size
    keys, sink = KeyShifter(engine.runner, engine.kv), blocks.blocks_needed(sink_tokens)
    cap = len(ids) if policy == "full" else context
    out, shifts, held, pos = TokenScores(), [], [], 0
    blocks.allocate(SEQ_ID)
    try:
        while pos < len(ids) - 1:
            if blocks.num_tokens[SEQ_ID] >= cap:
                drop = plan_drop(len(blocks.block_tables[SEQ_ID]), sink)
                held = held[:sink * bs] + held[(sink + drop) * bs:]
                shifts.append(pos)
                if policy == "shift":
                    moved = shift(blocks, SEQ_ID, sink, drop)
                    engine.kv.copy_blocks(moved.copies)
                    keys.shift(moved.moved, moved.delta)
                else:  # the kept tokens again, from scratch
                    blocks.free(SEQ_ID)
                    blocks.allocate(SEQ_ID)
                    for i in range(0, len(held), chunk):
                        _prefill(engine, held[i:i + chunk])
            n = min(cap - blocks.num_tokens[SEQ_ID], chunk, len(ids) - 1 - pos)
            _score(engine, ids[pos:pos + n], ids[pos + 1:pos + n + 1], out)
            held += ids[pos:pos + n]
            pos += n
    finally:
        blocks.free(SEQ_ID)
    return out, shifts


def _ppl(nll: list[float]) -> float:
    import math

    return math.exp(sum(nll) / len(nll)) if nll else float("nan")


def evaluate(engine, ids: list[int], *, context: int, sink_tokens: int) -> dict:
    """Every policy over one stream: perplexity after the first shift, and overall."""
    runs = {p: score_stream(engine, ids, p, context=context, sink_tokens=sink_tokens)
            for p in POLICIES}
    first = runs["shift"][1][0] if runs["shift"][1] else len(ids) - 1
    shift_top1, fresh_top1 = runs["shift"][0].top1[first:], runs["fresh"][0].top1[first:]
    return {
        "tokens": len(ids), "shifts": len(runs["shift"][1]), "first_shift": first,
        "ppl_after_first_shift": {p: _ppl(r.nll[first:]) for p, (r, _) in runs.items()},
        "ppl_all": {p: r.perplexity for p, (r, _) in runs.items()},
        "top1_agreement_shift_vs_fresh": (
            sum(a == b for a, b in zip(shift_top1, fresh_top1, strict=True))
            / max(1, len(shift_top1))),
    }


def markdown(result: dict) -> str:
    lines = ["| stream | tokens | shifts | shift (rotated K) | fresh window (recomputed) | "
             "full context | top-1 shift = fresh |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in result["streams"]:
        p = r["ppl_after_first_shift"]
        lines.append(f"| seed {r['seed']} | {r['tokens']} | {r['shifts']} | {p['shift']:.2f} | "
                     f"{p['fresh']:.2f} | {p['full']:.2f} | "
                     f"{report.pct(r['top1_agreement_shift_vs_fresh'])} |")
    return "\n".join([f"KV pool: {result.get('kv_format', 'float')}", ""] + lines)


def run(args) -> int:
    from app.eval.docs import document
    from engine import Engine, EngineConfig, load_model

    if args.kv_kivi and not args.kv_bits:
        raise SystemExit("kvchat: error: --kv-kivi needs --kv-bits 8 or 4")
    started = time.perf_counter()
    loaded = load_model(args.model, weights=args.weights)
    eng = Engine(loaded, EngineConfig(kv_budget_bytes=512 << 20, disk_cache=False,
                                      prefix_cache=False, kv_bits=args.kv_bits,
                                      kv_residual=args.kv_kivi, kv_key_channel=args.kv_kivi))
    from engine.model.rope_shift import refusal

    if refusal(eng.runner):
        raise SystemExit(f"kvchat: error: {refusal(eng.runner)}")
    need = args.factor * args.context + 1
    if need > eng.max_context:
        raise SystemExit(f"kvchat: error: {need} tokens exceed the model's context "
                         f"({eng.max_context}); the full-context floor needs them")
    streams = []
    try:
        for seed in range(args.seed, args.seed + args.streams):
            ids = eng.tokenizer.encode(document(seed, need, eng.count_tokens))[:need]
            r = evaluate(eng, ids, context=args.context, sink_tokens=args.sinks)
            streams.append({"seed": seed, **r})
            log(f"seed {seed}: " + ", ".join(f"{p} {v:.2f}" for p, v in
                                             r["ppl_after_first_shift"].items()))
    finally:
        eng.shutdown()
    result = {"model": loaded.name or "default", "context": args.context,
              "factor": args.factor, "sink_tokens": args.sinks, "kv_bits": args.kv_bits,
              "kv_format": eng.layout.kv_format,
              "block_size": eng.layout.block_size, "streams": streams,
              "seconds": round(time.perf_counter() - started, 1)}
    report.publish(markdown(result), result, args.out, "shift_eval", args.json)
    return 0


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``shift`` on the subparsers of ``kvchat eval``."""
    from app import arg_types

    p = subparsers.add_parser("shift", help="context shift: perplexity of a long stream "
                                            "against a fresh window and the full context",
                              description=__doc__.splitlines()[0])
    p.add_argument("--context", type=arg_types.int_in(64, 1 << 16), default=512,
                   help="tokens the shifting sequence may hold (512)")
    p.add_argument("--factor", type=arg_types.int_in(2, 16), default=3,
                   help="stream length in contexts (3)")
    p.add_argument("--sinks", type=arg_types.int_in(0, 1024), default=4,
                   help="tokens kept at the start, rounded up to blocks (4)")
    p.add_argument("--streams", type=arg_types.int_in(1, 20), default=3,
                   help="texts to score (3)")
    p.add_argument("--seed", type=arg_types.int_in(1, 10_000), default=41,
                   help="first text's seed (41)")
    p.add_argument("--kv-bits", type=int, choices=[8, 4], default=None,
                   help="a quantized K/V pool (the shift re-quantizes the moved keys)")
    p.add_argument("--kv-kivi", action="store_true",
                   help="with --kv-bits: the residual format, keys per channel (the shift "
                        "re-quantizes moved full blocks, moves the filling one's rows exactly)")
    p.add_argument("--weights", choices=["auto", "float32"], default="auto",
                   help="weight format (auto)")
    p.add_argument("--json", default=None, metavar="FILE", help="write every figure as JSON")
    p.add_argument("--out", default="shift-eval", metavar="DIR",
                   help="directory for shift_eval.md (shift-eval)")
    p.add_argument("--model", default=None, help="model (default: the embedded one)")
    p.set_defaults(func=run)
    return p
