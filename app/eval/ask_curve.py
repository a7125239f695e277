"""`kvchat eval ask --curve`: which prompt budget recalls most, for the model in use.

A tuning set (generated documents of 1k-8k tokens, five needles each at depths 0.1-0.9)
gives needle recall against document length for a plain whole-document prompt, and for
``kvchat ask`` with a prompt budget of 1k, 2k and 4k tokens (whole below it, retrieval
above). The budget suggested is the one with the best recall over the set (the larger
on a tie: documents up to it stay whole, a pinned prefix the next question reuses, and a
question that needs more than one passage gets more of the text). A held-out set (other
seeds, 4k-8k tokens) then checks the model's recorded default (`app.documents.budgets`)
against the plain prompt.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

from app.eval.probes import haystack, needle_prompt, pick_needles

TUNING = (1024, 2048, 3072, 4096, 6144, 7900)
HELD_OUT = (4096, 5120, 6144, 7168, 7900)
BUDGETS = (1024, 2048, 4096)
NEEDLES = 5
ANSWER_TOKENS = 24
SUFFIX = " Answer with the number from the text."


def log(message: str) -> None:
    print(f"[eval ask --curve] {message}", file=sys.stderr, flush=True)


def probe_set(lengths, seeds, count) -> list[tuple[int, int, str, list]]:
    """(length, seed, text, needles) per generated document."""
    out = []
    for seed in seeds:
        for n in lengths:
            needles = pick_needles(seed * 100 + n, NEEDLES)
            text, _ = haystack(seed * 100 + n, needles, n, count, overhead=48)
            out.append((n, seed, text, needles))
    return out


def answer(eng, ids) -> str:
    from engine import SamplingParams
    from engine.generation import collect

    return collect(eng.generate(ids, SamplingParams(max_tokens=ANSWER_TOKENS))).text


def recall(eng, docs, tmp: Path, budgets) -> list[dict]:
    """One row per needle: recalled by the plain prompt, and by ask at each budget."""
    from app.documents.load import load_document
    from app.documents.qa import DocumentQA

    rows = []
    for d, (n, seed, text, needles) in enumerate(docs):
        path = tmp / f"doc{d}.txt"
        path.write_text(text)
        qas = {str(b): DocumentQA(eng, [load_document(path)], prompt_budget=b) for b in budgets}
        for needle in needles:
            row = {"length": n, "seed": seed, "needle": needle.value,
                   "plain": needle.value in answer(eng, eng.encode_prompt(
                       needle_prompt(text, needle)))}
            for label, qa in qas.items():
                prepared = qa.prepare(needle.question + SUFFIX, answer_tokens=ANSWER_TOKENS)
                row[label] = needle.value in answer(eng, prepared.ids)
                row[f"{label}_mode"] = prepared.placement.mode
            rows.append(row)
        log(f"{n} tokens (seed {seed}): " + ", ".join(
            f"{k} {sum(r[k] for r in rows[-len(needles):])}/{len(needles)}"
            for k in ("plain", *qas)))
    return rows


def table(rows: list[dict], columns: list[str]) -> list[dict]:
    out = []
    for n in dict.fromkeys(r["length"] for r in rows):
        mine = [r for r in rows if r["length"] == n]
        out.append({"length": n, "probes": len(mine),
                    **{c: sum(r[c] for r in mine) for c in columns}})
    out.append({"length": "all", "probes": len(rows),
                **{c: sum(r[c] for r in rows) for c in columns}})
    return out


def markdown(rows: list[dict], columns: list[str], names: dict[str, str]) -> str:
    lines = ["| document tokens | " + " | ".join(names[c] for c in columns) + " |",
             "|---:|" + "---:|" * len(columns)]
    for t in rows:
        lines.append(f"| {t['length']} | " + " | ".join(f"{t[c]}/{t['probes']}"
                                                      for c in columns) + " |")
    return "\n".join(lines)


def run(args) -> int:
    from app.documents.budgets import prompt_budget
    from engine import Engine, EngineConfig, load_model

    started = time.perf_counter()
    loaded = load_model(args.model)
    eng = Engine(loaded, EngineConfig(kv_budget_bytes=1 << 30, disk_cache=False))
    default, source = prompt_budget(loaded)
    try:
        with tempfile.TemporaryDirectory(prefix="kvchat-eval-curve-") as tmp:
            seeds = (1, 2) if not args.quick else (1,)
            tuning = probe_set(TUNING if not args.quick else (1024, 4096), seeds,
                               eng.count_tokens)
            budgets = BUDGETS if not args.quick else (2048,)
            tune_rows = recall(eng, tuning, Path(tmp), budgets)
            cols = ["plain", *map(str, budgets)]
            totals = {c: sum(r[c] for r in tune_rows) for c in map(str, budgets)}
            best = max(budgets, key=lambda b: (totals[str(b)], b))
            held_budget = default if default is not None else best
            held = probe_set(HELD_OUT if not args.quick else (4096,), (7, 8)[:len(seeds)],
                             eng.count_tokens)
            held_rows = recall(eng, held, Path(tmp), (held_budget,))
    finally:
        eng.shutdown()
    names = {"plain": "plain whole-document prompt", **{str(b): f"kvchat ask, budget {b}"
                                                        for b in (*budgets, held_budget)}}
    result = {"model": loaded.name or "default", "fingerprint": loaded.fingerprint,
              "tuning": table(tune_rows, cols), "suggested_budget": best,
              "recorded_budget": default, "recorded_source": source,
              "held_out": table(held_rows, ["plain", str(held_budget)]),
              "rows": {"tuning": tune_rows, "held_out": held_rows},
              "seconds": round(time.perf_counter() - started, 1)}
    text = ("Tuning set (needle recall):\n\n" + markdown(result["tuning"], cols, names)
            + f"\n\nSuggested budget for {result['model']}: {best} tokens (recorded: "
            f"{default}).\n\nHeld-out documents (other seeds), the budget {held_budget}:\n\n"
            + markdown(result["held_out"], ["plain", str(held_budget)], names))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ask_curve.md").write_text(text + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(text)
    return 0
