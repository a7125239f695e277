#!/usr/bin/env python3
"""kvchat vs llama.cpp's C++ `llama-bench`, side by side in one run, at real sizes.

    scripts/bench_vs_llama_bench.py --llama-bench PATH/llama-bench \\
        MODEL[=PEER.gguf] [MODEL[=PEER.gguf] ...] [--prompt-tokens 512] [--gen 32] [--repeats 2]

MODEL is a .gguf file (llama-bench runs the same file) or an MLX directory with the GGUF to
compare it with after ``=``. Per model and repeat, interleaved: llama-bench (pp N; tg G at
depth N, the context kvchat decodes at; threads = cores) and a fresh ``kvchat generate
--json`` process on a prompt of ~N tokens (cold: ``--no-disk-cache``, a new tenant each
run, so nothing is cached), timed under ``/usr/bin/time -v`` for peak RSS. Prints medians
and kvchat / llama.cpp ratios (> 1: kvchat faster). Random-weight models come from
``kvchat dev make-model``; GGUF K-quants from llama.cpp's ``llama-quantize``.

``kvchat bench --peer llama-bench`` is the same comparison in kvchat's own bench (same
llama-bench commands, `app.bench.llama_bench`), in one process with every prefill cold;
this script stays for what that does not measure: a fresh kvchat process per run, its peak
RSS and load time, and MLX model directories paired with a GGUF.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KVCHAT = [sys.executable, "-m", "app.cli"]


def llama_bench(binary: str, gguf: str, n_prompt: int, n_gen: int) -> dict:
    """Prefill of ``n_prompt`` tokens (pp, empty context), and decode of ``n_gen`` tokens
    after ``n_prompt`` (tg at depth ``n_prompt``): where kvchat's decode runs, since a
    decode step's attention reads the whole context. The same commands and parsing as
    ``kvchat bench --peer llama-bench`` (`app.bench.llama_bench`), one repetition each."""
    from app.bench.llama_bench import command, rates, run_test

    opts = dict(threads=os.cpu_count() or 1, repeats=1)
    pp = run_test(command(binary, Path(gguf), n_prompt=n_prompt, n_gen=0, depth=0, **opts))
    tg = run_test(command(binary, Path(gguf), n_prompt=0, n_gen=n_gen, depth=n_prompt, **opts))
    return {"prefill": rates(pp)[0], "decode": rates(tg)[0]}


def kvchat_run(model: str, prompt_file: str, n_gen: int, tenant: str) -> dict:
    cmd = ["/usr/bin/time", "-v", *KVCHAT, "generate", "--model", model, "--prompt-file",
           prompt_file, "--raw", "--max-tokens", str(n_gen), "--json", "--no-disk-cache",
           "--tenant", tenant]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-2000:])
    result = json.loads(proc.stdout)
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr).group(1))
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([\d:.]+)", proc.stderr)
    parts = [float(p) for p in wall.group(1).split(":")]
    seconds = sum(p * 60 ** i for i, p in enumerate(reversed(parts)))
    decode_s = (result["generation_tokens"] - 1) / max(result["decode_tps"], 1e-9)
    return {"prefill": result["prefill_tps"], "decode": result["decode_tps"],
            "prompt_tokens": result["prompt_tokens"], "cached": result["cached_tokens"],
            "rss_mb": rss / 1024, "load_s": seconds - result["ttft_s"] - decode_s,
            "weights": result["model"].get("weight_format")}


def prompt_text(n_tokens: int) -> str:
    # held-out prose (not in the repository), ~1.2 tokens per word in this vocabulary
    words = Path("/usr/share/common-licenses/GPL-3").read_text().split()
    return " ".join(words[: int(n_tokens / 1.23)])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--llama-bench", required=True)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(prompt_text(args.prompt_tokens))
    rows = []
    for spec in args.models:
        model, _, peer = spec.partition("=")
        peer = peer or model
        kv, lc = [], []
        for r in range(args.repeats):
            lc.append(llama_bench(args.llama_bench, peer, args.prompt_tokens, args.gen))
            kv.append(kvchat_run(model, f.name, args.gen, tenant=f"bench-{os.getpid()}-{r}"))
            if kv[-1]["cached"]:
                print(f"NOT COLD: {model} run {r} had {kv[-1]['cached']} cached tokens")
        med = {k: statistics.median(x[k] for x in kv) for k in ("prefill", "decode", "rss_mb")}
        # the first run of a GGUF also converts it (once, cached): load is the fastest run's
        med["load_s"], med["first_load_s"] = min(x["load_s"] for x in kv), kv[0]["load_s"]
        peer_med = {k: statistics.median(x[k] for x in lc) for k in ("prefill", "decode")}
        rows.append((model, peer, kv[0], med, peer_med))
    print(f"\n{args.prompt_tokens}-token prompt (kvchat: {rows[0][2]['prompt_tokens']} tokens), "
          f"{args.gen} new tokens, median of {args.repeats}, {os.cpu_count()} threads")
    print("| model | kvchat weights | kvchat prefill / decode tok/s | llama-bench prefill / "
          "decode (peer file) | prefill ratio | decode ratio | kvchat peak RSS | load s "
          "(first run) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for model, peer, first, m, p in rows:
        print(f"| {Path(model).name} | {first['weights']} | {m['prefill']:.1f} / "
              f"{m['decode']:.2f} | {p['prefill']:.1f} / {p['decode']:.2f} ({Path(peer).name}) "
              f"| {m['prefill'] / p['prefill']:.2f}x | {m['decode'] / p['decode']:.2f}x "
              f"| {m['rss_mb']:.0f} MB (file {_size_mb(model):.0f} MB) | {m['load_s']:.1f} "
              f"({m['first_load_s']:.1f}) |")
    return 0


def _size_mb(path: str) -> float:
    p = Path(path)
    files = [p] if p.is_file() else list(p.glob("*.safetensors"))
    return sum(f.stat().st_size for f in files) / 2**20


if __name__ == "__main__":
    sys.exit(main())
