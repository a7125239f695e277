"""`kvchat eval chat`: do long conversations remember what was said early?

Scripted conversations: the user states facts in the first turns ("Please remember
this: the locker number of the chess club is 4817."), then talks on (general questions,
scripted answers of generated local history) until the conversation is 2x and 4x the
chat's budget (`app.context_policy.default_chat_budget`, unless ``--budget``); then
each fact is asked for, with the history the chat would send under each policy:
- ``summarize``: as the chat runs it, a summary request after every turn that takes the
  conversation past its trigger (`app.context_policy.summary_job`), the summary sent
  with the turns it does not cover;
- ``truncate``: the newest turns that fit the budget;
- ``full``: the whole history, where it fits the model's context.
A fact counts as recalled when its number is in the greedy answer. Names and numbers are
generated, so no fact is known to the model beforehand; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import sys
import time

from app.eval import report
from app.eval.docs import Region
from app.eval.probes import AGREEMENT_PROMPTS, pick_needles

FACTS = 4
ANSWER_TOKENS = 24
MODES = ("summarize", "truncate", "full")


def log(message: str) -> None:
    print(f"[eval chat] {message}", file=sys.stderr, flush=True)


def conversation(seed: int, target_tokens: int, count) -> tuple[list[dict], list]:
    """(messages, needles): facts in the first turns, then talk up to ``target_tokens``."""
    needles = pick_needles(3000 + seed, FACTS)
    history: list[dict] = []
    for n in needles:
        history += [{"role": "user", "content": f"Please remember this for later: {n.fact}"},
                    {"role": "assistant", "content": "Got it, I will remember that."}]
    paragraphs = Region(seed).paragraphs()
    used = sum(count(m["content"]) + 4 for m in history)
    i = seed
    while used < target_tokens:
        question = AGREEMENT_PROMPTS[i % len(AGREEMENT_PROMPTS)]
        reply = " ".join(next(paragraphs) + next(paragraphs))
        history += [{"role": "user", "content": question},
                    {"role": "assistant", "content": reply}]
        used += count(question) + count(reply) + 8
        i += 1
    return history, needles


def question_of(needle) -> str:
    return f"What is the {needle.key}? Answer with the number."


def answer(eng, ids) -> str:
    from engine import SamplingParams
    from engine.generation import collect

    return collect(eng.generate(ids, SamplingParams(max_tokens=ANSWER_TOKENS))).text


def summarize_along(eng, history: list[dict], budget: int) -> tuple[object, list[str]]:
    """The summary the chat would hold at the end: one job after each turn that needs it."""
    from app.context_summary import summary_job

    summary, labels = None, []
    for end in range(2, len(history) + 1, 2):
        job = summary_job(eng, history[:end], summary, budget=budget)
        if job is not None and job.run() is not None:
            summary = job.result
            labels.append(summary.label())
    return summary, labels


def probe(eng, history, needles, budget: int) -> dict:
    """Every fact asked under each mode; what each prompt held."""
    from app.context_policy import fit

    count = eng.count_tokens
    summary, labels = summarize_along(eng, history, budget)
    out = {"history_tokens": sum(count(m["content"]) + 4 for m in history),
           "summaries": labels, "summary": summary.text if summary is not None else None,
           "answers": []}
    for needle in needles:
        q = question_of(needle)
        row = {"value": needle.value}
        for mode in MODES:
            if mode == "full":
                ids = eng.encode_prompt(q, history=history)
                if len(ids) + ANSWER_TOKENS > eng.max_context:
                    row[mode] = None  # does not fit the context
                    continue
            else:
                f = fit(history, policy=mode, budget=budget, count=count, question=q,
                        summary=summary)
                ids = eng.encode_prompt(q, system=f.system or None, history=f.history)
                row[f"{mode}_context"] = f.to_dict()
            text = answer(eng, ids)
            row[mode] = {"answer": text, "recalled": needle.value in text,
                         "prompt_tokens": len(ids)}
        out["answers"].append(row)
    return out


def tally(results: list[dict]) -> list[dict]:
    table = []
    for scale in dict.fromkeys(r["scale"] for r in results):
        mine = [a for r in results if r["scale"] == scale for a in r["answers"]]
        line = {"scale": scale, "probes": len(mine),
                "history_tokens": [r["history_tokens"] for r in results if r["scale"] == scale]}
        for mode in MODES:
            got = [a[mode] for a in mine if a[mode] is not None]
            line[mode] = [sum(g["recalled"] for g in got), len(got)]
        table.append(line)
    return table


def markdown(result: dict) -> str:
    b = result["budget"]
    lines = [f"| conversation | tokens | summarize | truncate | full history (context "
             f"{result['context']}) |", "|---|---:|---:|---:|---:|"]
    for t in result["table"]:
        cells = [f"{t[m][0]}/{t[m][1]}" if t[m][1] else "does not fit" for m in MODES]
        lines.append(f"| {t['scale']}x the budget ({b}) | "
                     f"{min(t['history_tokens'])}-{max(t['history_tokens'])} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def run(args) -> int:
    from app.context_policy import default_chat_budget
    from engine import Engine, EngineConfig, load_model

    started = time.perf_counter()
    loaded = load_model(args.model)
    eng = Engine(loaded, EngineConfig(kv_budget_bytes=1 << 30, disk_cache=False))
    budget = args.budget or default_chat_budget(eng.max_context)
    seeds = range(args.seed, args.seed + (1 if args.quick else args.conversations))
    results = []
    try:
        for scale in (2, 4):
            for seed in seeds:
                history, needles = conversation(seed, scale * budget, eng.count_tokens)
                r = probe(eng, history, needles, budget)
                results.append({"scale": scale, "seed": seed, **r})
                log(f"{scale}x seed {seed}: {r['history_tokens']} tokens, "
                    f"{len(r['summaries'])} summaries; " + ", ".join(
                        f"{m} {sum(bool(a[m] and a[m]['recalled']) for a in r['answers'])}"
                        for m in MODES))
    finally:
        eng.shutdown()
    result = {"model": loaded.name or "default", "budget": budget, "context": eng.max_context,
              "seeds": list(seeds),
              "facts_per_conversation": FACTS, "table": tally(results),
              "conversations": results, "seconds": round(time.perf_counter() - started, 1)}
    report.publish(markdown(result), result, args.out, "chat_eval", args.json)
    return 0


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``chat`` on the subparsers of ``kvchat eval``."""
    from app import arg_types

    p = subparsers.add_parser("chat", help="long conversations: recall of early facts under "
                                           "summarize, truncate and the full history",
                              description=__doc__.splitlines()[0])
    p.add_argument("--budget", type=arg_types.int_in(256), default=None, metavar="TOKENS",
                   help="the chat budget (default: the chat's, a quarter of the context)")
    p.add_argument("--conversations", type=arg_types.int_in(1, 50), default=3,
                   help="scripted conversations per length (3)")
    p.add_argument("--seed", type=arg_types.int_in(1, 10_000), default=1,
                   help="first conversation's seed (1; 1-3 and 11-13 were looked at while "
                        "building the summaries: held-out figures start at 21)")
    p.add_argument("--json", default=None, metavar="FILE", help="write every figure as JSON")
    p.add_argument("--out", default="chat-eval", metavar="DIR",
                   help="directory for chat_eval.md (chat-eval)")
    p.add_argument("--quick", action="store_true", help="one conversation per length")
    p.add_argument("--model", default=None, help="model (default: the embedded one)")
    p.set_defaults(func=run)
    return p
