"""`kvchat eval ask`: needle recall of document Q&A, and what the pinned prefix saves.

Each probe is a document with facts ("The PIN of the lighthouse radio is 5521.") at
chosen depths and one question per fact, asked two ways on the same engine:
- through `DocumentQA`, the code behind ``kvchat ask`` (document written to a file and
  loaded by the same loader; whole as a pinned prefix when it fits, BM25 chunks when not);
- as a plain prompt, the whole document then the question, where it fits the context.
Documents: generated haystacks at 1k-7k tokens and one 3x the context (the retrieval
path), and held-out real texts not in the repository (the licence texts every Debian
machine has in /usr/share/common-licenses) with needles inserted between sentences.

The TTFT part asks three questions about one 4k-token document: the first cold, the
second on the same engine (RAM), the third on a new engine over the same disk store.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from pathlib import Path

from app.eval import report
from app.eval.probes import depths, haystack, pick_needles, place

HELD_OUT = ("/usr/share/common-licenses/Apache-2.0", "/usr/share/common-licenses/GFDL-1.3",
            "/usr/share/common-licenses/GPL-3")
ANSWER_TOKENS = 24
SUFFIX = " Answer with the number from the text."


def log(message: str) -> None:
    print(f"[eval ask] {message}", file=sys.stderr, flush=True)


def documents(count, context: int, quick: bool) -> list[tuple[str, str, list]]:
    """(label, text, needles) of every probe document."""
    sizes = (1024, 2048) if quick else (1024, 2048, 4096, 7168)
    docs = []
    for i, n in enumerate(sizes):
        needles = pick_needles(500 + i, 3)
        docs.append((f"generated {n // 1024}k", haystack(500 + i, needles, n, count)[0], needles))
    big = 2 * context if quick else 3 * context
    needles = pick_needles(600, 2 if quick else 4)
    docs.append((f"generated {big // 1024}k (3x context)" if not quick else "generated 2x",
                 haystack(600, needles, big, count)[0], needles))
    for j, path in enumerate(HELD_OUT[:1] if quick else HELD_OUT):
        try:
            text = Path(path).read_text()
        except OSError:
            log(f"held-out {path} is missing: skipped")
            continue
        filler = [s for s in re.split(r"(?<=[.;:])\s+", " ".join(text.split())) if s]
        needles = pick_needles(700 + j, 2)
        placed, _ = place(filler, list(zip(depths(2), (n.fact for n in needles), strict=True)),
                          count)
        docs.append((f"held-out {Path(path).name}", placed, needles))
    return docs


def _answer(eng, ids, max_tokens=ANSWER_TOKENS) -> dict:
    from engine import SamplingParams
    from engine.generation import collect

    r = collect(eng.generate(ids, SamplingParams(max_tokens=max_tokens)))
    return {"answer": r.text, "ttft_s": r.stats.ttft_s, "cached_tokens": r.stats.cached_tokens,
            "cache_source": r.stats.cache_source, "prompt_tokens": r.stats.prompt_tokens}


def recall_probes(eng, docs, tmp: Path) -> list[dict]:
    from app.documents.load import load_document
    from app.documents.qa import DocumentQA
    from app.eval.probes import needle_prompt

    rows = []
    for d, (label, text, needles) in enumerate(docs):
        path = tmp / f"doc{d}.txt"
        path.write_text(text)
        qa = DocumentQA(eng, [load_document(path)])
        for needle in needles:
            prepared = qa.prepare(needle.question + SUFFIX, answer_tokens=ANSWER_TOKENS)
            ask = _answer(eng, prepared.ids)
            plain_ids = eng.encode_prompt(needle_prompt(text, needle))
            plain = (_answer(eng, plain_ids)
                     if len(plain_ids) + ANSWER_TOKENS <= eng.max_context else None)
            rows.append({
                "document": label, "doc_tokens": qa.total_tokens, "needle": needle.value,
                "mode": prepared.placement.mode, "left_out": prepared.report(qa.docs),
                "ask": {**ask, "recalled": needle.value in ask["answer"]},
                "plain": None if plain is None
                else {**plain, "recalled": needle.value in plain["answer"]},
            })
            log(f"{label}: {needle.value} ask={rows[-1]['ask']['recalled']} "
                f"plain={None if plain is None else rows[-1]['plain']['recalled']} "
                f"({prepared.placement.mode})")
    return rows


def ttft_probe(loaded, count, tmp: Path) -> dict:
    from app.documents.load import load_document
    from app.documents.qa import DocumentQA
    from engine import Engine, EngineConfig

    needles = pick_needles(800, 3)
    path = tmp / "ttft.txt"
    path.write_text(haystack(800, needles, 4096, count)[0])
    config = EngineConfig(kv_budget_bytes=1 << 30, disk_cache=True,
                          disk_cache_dir=str(tmp / "store"))
    out = {}

    def ask(eng, qa, needle) -> dict:
        prepared = qa.prepare(needle.question + SUFFIX, answer_tokens=ANSWER_TOKENS)
        return _answer(eng, prepared.ids)

    eng = Engine(loaded, config)
    qa = DocumentQA(eng, [load_document(path)])
    out["cold"], out["ram"] = ask(eng, qa, needles[0]), ask(eng, qa, needles[1])
    eng.shutdown()  # drains the disk writer: the blocks are on disk
    eng = Engine(loaded, config)  # a fresh pool: nothing in RAM
    out["disk"] = ask(eng, DocumentQA(eng, [load_document(path)]), needles[2])
    eng.shutdown()
    out["ram_speedup"] = out["cold"]["ttft_s"] / out["ram"]["ttft_s"]
    out["disk_speedup"] = out["cold"]["ttft_s"] / out["disk"]["ttft_s"]
    return out


def summarize(rows: list[dict]) -> list[dict]:
    table = []
    for label in dict.fromkeys(r["document"] for r in rows):
        mine = [r for r in rows if r["document"] == label]
        plain = [r for r in mine if r["plain"] is not None]
        table.append({
            "document": label, "tokens": mine[0]["doc_tokens"], "mode": mine[0]["mode"],
            "probes": len(mine), "ask": sum(r["ask"]["recalled"] for r in mine),
            "plain": sum(r["plain"]["recalled"] for r in plain) if plain else None,
            "plain_probes": len(plain)})
    return table


def markdown(result: dict) -> str:
    lines = ["| document | tokens | kvchat ask path | ask recall | plain prompt recall |",
             "|---|---:|---|---:|---:|"]
    for t in result["table"]:
        plain = f"{t['plain']}/{t['plain_probes']}" if t["plain"] is not None else \
            "does not fit"
        lines.append(f"| {t['document']} | {t['tokens']} | {t['mode']} | "
                     f"{t['ask']}/{t['probes']} | {plain} |")
    a, p = result["ask_recall"], result["plain_recall"]
    lines.append(f"| **all** | | | **{a[0]}/{a[1]}** | **{p[0]}/{p[1]}** (where it fits) |")
    t = result["ttft"]
    lines += ["", f"TTFT on a 4k-token document: cold {t['cold']['ttft_s']:.2f} s, "
              f"second question {t['ram']['ttft_s']:.3f} s ({t['ram_speedup']:.0f}x, "
              f"{t['ram']['cached_tokens']} tokens cached in RAM), new engine over the same "
              f"disk store {t['disk']['ttft_s']:.3f} s ({t['disk_speedup']:.0f}x, "
              f"{t['disk']['cached_tokens']} tokens from {t['disk']['cache_source']})."]
    return "\n".join(lines)


def run(args) -> int:
    from engine import Engine, EngineConfig, load_model

    if args.curve:
        from app.eval import ask_curve

        return ask_curve.run(args)
    started = time.perf_counter()
    loaded = load_model(args.model)
    eng = Engine(loaded, EngineConfig(kv_budget_bytes=1 << 30))
    try:
        docs = documents(eng.count_tokens, eng.max_context, args.quick)
        log(f"{len(docs)} documents, {sum(len(n) for _, _, n in docs)} probes")
        with tempfile.TemporaryDirectory(prefix="kvchat-eval-ask-") as tmp:
            rows = recall_probes(eng, docs, Path(tmp))
            eng.shutdown()
            ttft = ttft_probe(loaded, eng.count_tokens, Path(tmp))
    finally:
        eng.shutdown()
    plain = [r for r in rows if r["plain"] is not None]
    result = {"table": summarize(rows), "rows": rows, "ttft": ttft,
              "ask_recall": [sum(r["ask"]["recalled"] for r in rows), len(rows)],
              "plain_recall": [sum(r["plain"]["recalled"] for r in plain), len(plain)],
              "model": loaded.name or "default", "context": eng.max_context,
              "seconds": round(time.perf_counter() - started, 1)}
    report.publish(markdown(result), result, args.out, "ask_eval", args.json)
    return 0


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``ask`` on the subparsers of ``kvchat eval``."""
    p = subparsers.add_parser("ask", help="document Q&A: needle recall and cached TTFT",
                              description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None, metavar="FILE", help="write every figure as JSON")
    p.add_argument("--out", default="ask-eval", metavar="DIR",
                   help="directory for ask_eval.md (ask-eval)")
    p.add_argument("--quick", action="store_true", help="a small run (smoke checks)")
    p.add_argument("--curve", action="store_true",
                   help="instead: recall against document length and prompt budget, the "
                        "budget it suggests, and the recorded default on held-out documents "
                        "(ask_curve.md)")
    p.add_argument("--model", default=None, help="model (default: the embedded one)")
    p.set_defaults(func=run)
    return p
