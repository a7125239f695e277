"""The held-out KV quality table alone: `kvchat eval kv`'s perplexity phase, nothing else.

Each text's first ``--tokens`` tokens (raw, no chat template) are scored teacher-forced
through the pool in 512-token chunks, exactly as `kvchat eval kv --text` does
(`app.eval.perplexity.score_text`), for every format of `app.eval.kv.FORMATS`; the first
format is the reference (perplexity change, top-1 agreement and KL(reference || format)).
The needle, JSON and speed phases of the full eval are left out: on a 2-core machine they
take many minutes per format.

    python scripts/kv_heldout.py --text /usr/share/common-licenses/GPL-3 \
        --text /usr/share/common-licenses/GFDL-1.3 --tokens 2048 --formats f16,q8,q4-kivi
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

from engine import load_model  # first: importing engine preloads OpenBLAS

# isort: split
from app.eval.kv import FORMATS
from app.eval.measure import with_engine
from app.eval.perplexity import TokenScores, score_text


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--text", action="append", required=True, metavar="FILE")
    p.add_argument("--tokens", type=int, default=2048, help="tokens scored per text")
    p.add_argument("--formats", default="f16,q8,k8v4,q4", help="the first is the reference")
    args = p.parse_args()
    names = [n.strip() for n in args.formats.split(",") if n.strip()]
    unknown = [n for n in names if n not in FORMATS]
    if unknown:
        p.error(f"unknown format {', '.join(unknown)}")
    loaded = load_model()
    texts = [Path(t).read_text(encoding="utf-8", errors="replace") for t in args.text]
    ref: list[TokenScores] = []
    print("| format | bytes / token | perplexity | vs ref | top-1 agreement | mean KL (nats) |")
    print("|---|---:|---:|---:|---:|---:|")
    base = None
    for name in names:
        t0 = time.perf_counter()
        runs: list[TokenScores] = []
        info: dict = {}

        def score(engine, runs=runs, info=info, ref=ref) -> None:
            info["bytes"] = engine.layout.bytes_per_token
            for i, text in enumerate(texts):
                ids = engine.encode_prompt(text, raw=True)[: args.tokens]
                runs.append(score_text(engine, ids, keep=not ref,
                                       reference=ref[i] if ref else None))

        with_engine(loaded, FORMATS[name], score, prefix_cache=False)
        nll = [x for r in runs for x in r.nll]
        ppl = math.exp(sum(nll) / len(nll))
        if not ref:
            ref.extend(runs)  # the reference run's kept distributions
            base = ppl
            print(f"| {name} | {info['bytes']:,} | {ppl:.4f} | | | |", flush=True)
            continue
        top = [a == b for r0, r in zip(ref, runs, strict=True)
               for a, b in zip(r0.top1, r.top1, strict=True)]
        kl = [x for r in runs for x in r.kl]
        print(f"| {name} | {info['bytes']:,} | {ppl:.4f} | {100 * (ppl / base - 1):+.2f} % "
              f"| {100 * sum(top) / len(top):.2f} % | {sum(kl) / len(kl):.5f} |", flush=True)
        print(f"[{name}: {time.perf_counter() - t0:.0f}s]", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
