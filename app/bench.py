"""`kvchat bench`: prefill and decode speed of kvchat next to mlx-lm as shipped.

Both sides get the same raw token ids (no chat template), decode greedily with
EOS ignored, and are timed by the same code (``time_stream``):

- prefill tok/s = prompt tokens / time to first token
- decode tok/s  = (generated tokens - 1) / (first token -> last token)
- inter-token latency (ITL) P50/P95 over the decode steps

kvchat runs in this process (float32 weights + OpenBLAS on CPU). mlx-lm runs the
way a user runs it: its own model code and ``generate_step``, the shipped
quantized weights, no OpenBLAS preload. That needs a fresh interpreter (the
preload is process-wide), so it runs as ``python -m app.bench_worker``,
which must never import ``engine`` (see `app.bench_worker`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

from app.bench_worker import (
    WARMUP_GEN_TOKENS,
    WORKER_FLAG,
    _log,
    summarize,
    time_stream,
)

WARMUP_PROMPT_TOKENS = 8


# -- the kvchat side and the report ---------------------------------------------------


def parse_lengths(text: str) -> list[int]:
    """'128,1024' -> [128, 1024] (positive, de-duplicated, in order)."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from e
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"lengths must be positive integers: {text!r}")
    return list(dict.fromkeys(values))


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {text}")
    return value


def add_parser(sub) -> None:
    """Register the ``bench`` subcommand on the CLI's subparsers object."""
    from app.cli import add_engine_args

    p = sub.add_parser(
        "bench",
        help="prefill/decode speed of kvchat vs mlx-lm (a benchmark, not a test)",
        description=__doc__.splitlines()[0],
    )
    add_engine_args(p)
    p.add_argument("--lengths", type=parse_lengths, default=parse_lengths("128,1024,4096"),
                   help="prompt lengths in tokens, comma-separated (128,1024,4096)")
    p.add_argument("--gen-tokens", type=_positive, default=64,
                   help="tokens decoded per run, EOS ignored (64; at least 2)")
    p.add_argument("--repeats", type=_positive, default=1,
                   help="runs per length; the median is reported (1)")
    p.add_argument("--mlx-lm-max-prompt", type=int, default=1024,
                   help="skip mlx-lm for longer prompts: its CPU prefill with shipped "
                        "quantized weights is slow (1024)")
    p.add_argument("--no-mlx-lm", action="store_true", help="run kvchat only")
    p.add_argument("--json", metavar="FILE", default=None, help="write all results to FILE")
    p.set_defaults(func=run)
    # An optional sub-command: plain `kvchat bench [flags]` stays the comparison above, and
    # `kvchat bench load|prefix [flags]` (flags after the mode) runs another benchmark.
    from app import bench_load, bench_prefix

    modes = p.add_subparsers(dest="bench_mode", title="other benchmarks",
                             metavar="{load,prefix}")
    bench_load.add_parser(modes)
    bench_prefix.add_parser(modes)


def prompt_text() -> str:
    """A long, deterministic natural text: the source of two stdlib modules."""
    import inspect
    import textwrap

    return inspect.getsource(argparse) + inspect.getsource(textwrap)


def prompt_ids(tokenizer, lengths: list[int]) -> dict[int, list[int]]:
    """Token ids of exactly each length, all cut from one tokenized text."""
    need = max(lengths)
    lines = prompt_text().splitlines(keepends=True)
    ids: list[int] = []
    # Encode a few lines at a time (never past the model's max length, which would
    # make transformers warn) and only as far as needed; repeat the text if short.
    while len(ids) < need:
        for start in range(0, len(lines), 40):
            ids += tokenizer.encode("".join(lines[start:start + 40]))
            if len(ids) >= need:
                break
    return {n: ids[:n] for n in lengths}


def _machine() -> dict:
    import importlib.metadata

    from engine.model import memory

    cpu = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")),
                       cpu)
    except OSError:
        pass

    def version(pkg: str) -> str | None:
        try:
            return importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "backend": memory.backend(),
        "mlx": version("mlx"),
        "mlx_lm": version("mlx-lm"),
    }


def run_mlx_lm(model_path: Path, prompts: dict[int, list[int]], warmup: list[int],
               gen_tokens: int, repeats: int) -> dict:
    """Run the mlx-lm worker in a fresh interpreter without the OpenBLAS preload."""
    root = Path(__file__).resolve().parent.parent  # the directory holding `app`
    env = dict(os.environ, KVCHAT_BLAS="none")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    job = {"model_path": str(model_path), "gen_tokens": gen_tokens, "repeats": repeats,
           "warmup_ids": warmup, "prompts": [[n, ids] for n, ids in prompts.items()]}
    with tempfile.TemporaryDirectory(prefix="kvchat-bench-") as tmp:
        job_file = Path(tmp) / "job.json"
        job_file.write_text(json.dumps(job))
        # stderr is inherited so the worker's progress shows up live.
        cmd = [sys.executable, "-m", "app.bench_worker", WORKER_FLAG, str(job_file)]
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, env=env, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"the mlx-lm worker exited with status {proc.returncode} "
                           "(its error is above)")
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    if not lines:
        raise RuntimeError("the mlx-lm worker printed no result")
    return json.loads(lines[-1])


def _agree(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _public(summary: dict | None) -> dict | None:
    # Token ids are kept only as the agreement count; they would bloat the JSON.
    if summary is None:
        return None
    return {k: v for k, v in summary.items() if k != "tokens"}


def run(args) -> int:
    """Run the benchmark; print the table (stdout) and progress (stderr)."""
    import engine
    from app.cli import build_engine
    from engine import SamplingParams
    from engine.errors import KVChatError

    if args.gen_tokens < 2:
        raise KVChatError("--gen-tokens must be at least 2 to measure decode")
    _log("kvchat", "loading the model")
    eng = build_engine(args)
    loaded = eng.loaded
    lengths = list(args.lengths)
    notes: list[str] = []
    fits = [n for n in lengths if n + args.gen_tokens <= eng.max_context]
    for n in lengths:
        if n not in fits:
            notes.append(f"length {n} skipped for both: {n} + {args.gen_tokens} tokens exceed "
                         f"the context of {eng.max_context}")
    prompts = prompt_ids(eng.tokenizer, fits + [WARMUP_PROMPT_TOKENS])
    warmup = prompts[WARMUP_PROMPT_TOKENS]
    machine = _machine()

    def kvchat_run(ids: list[int], n: int) -> dict:
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        return time_stream(len(ids), lambda: (e.token for e in eng.generate(ids, params)
                                              if e.token is not None))

    _log("kvchat", "warm-up")
    kvchat_run(warmup, WARMUP_GEN_TOKENS)
    kv_results: dict[int, dict] = {}
    for n in fits:
        runs = []
        for i in range(args.repeats):
            _log("kvchat", f"length {n} run {i + 1}/{args.repeats}")
            runs.append(kvchat_run(prompts[n], args.gen_tokens))
        kv_results[n] = s = summarize(runs)
        _log("kvchat", f"length {n}: prefill {s['prefill_tps']:.1f} tok/s, "
                       f"decode {s['decode_tps']:.1f} tok/s")

    mlx_info: dict | None = None
    mlx_lengths = [] if args.no_mlx_lm else [n for n in fits if n <= args.mlx_lm_max_prompt]
    status = 0
    if args.no_mlx_lm:
        notes.append("mlx-lm not run (--no-mlx-lm)")
    elif mlx_lengths:
        _log("mlx-lm", f"starting a separate process for lengths {mlx_lengths} "
                       "(shipped weights, no OpenBLAS; this is the slow part)")
        try:
            mlx_info = run_mlx_lm(loaded.path, {n: prompts[n] for n in mlx_lengths}, warmup,
                                  args.gen_tokens, args.repeats)
        except (RuntimeError, OSError, ValueError) as e:
            notes.append(f"mlx-lm failed: {e}")
            status = 1
    mlx_results = {int(k): v for k, v in (mlx_info or {}).get("results", {}).items()}
    if not args.no_mlx_lm:
        slow = [n for n in fits if n > args.mlx_lm_max_prompt]
        if slow:
            notes.append(_skip_note(slow, args.mlx_lm_max_prompt, mlx_results, machine))

    for n in fits:
        if n in mlx_results:
            for side, s in (("kvchat", kv_results[n]), ("mlx-lm", mlx_results[n])):
                if s["generated_tokens"] != args.gen_tokens:
                    notes.append(f"length {n}: {side} decoded {s['generated_tokens']} tokens, "
                                 f"not {args.gen_tokens}")

    results = []
    for n in fits:
        kv, ml = kv_results[n], mlx_results.get(n)
        row = {
            "length": n,
            "kvchat": _public(kv),
            "mlx_lm": _public(ml),
            "mlx_lm_skipped": None if ml else _skip_reason(n, args),
            "prefill_ratio": kv["prefill_tps"] / ml["prefill_tps"] if ml else None,
            "decode_ratio": kv["decode_tps"] / ml["decode_tps"] if ml else None,
            "greedy_agree_tokens": _agree(kv["tokens"], ml["tokens"]) if ml else None,
        }
        results.append(row)

    report = {
        "machine": machine,
        "model": {
            "name": loaded.name,
            "path": str(loaded.path),
            "model_type": loaded.model_type,
            "fingerprint": loaded.fingerprint,
        },
        "settings": {
            "lengths": lengths, "gen_tokens": args.gen_tokens, "repeats": args.repeats,
            "mlx_lm_max_prompt": args.mlx_lm_max_prompt, "greedy": True, "ignore_eos": True,
            "prompt": "raw token ids cut from stdlib argparse+textwrap source, no chat template",
        },
        "kvchat": {
            "weight_format": loaded.weight_format,
            "device": machine["backend"],
            "blas": engine.model.blas.loaded_path,
            "gemv_shim": engine.model.blas.gemv_shim,
            "block_size": eng.config.block_size,
            "prefill_chunk": eng.config.prefill_chunk,
            # getattr: the engine's options evolve; the report should not break on them.
            "fuse_projections": getattr(eng.config, "fuse_projections", None),
        },
        "mlx_lm": None if mlx_info is None else {
            k: v for k, v in mlx_info.items() if k != "results"},
        "results": results,
        "notes": notes,
    }
    print_report(report)
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")
        _log("kvchat", f"wrote {args.json}")
    return status


def _skip_reason(n: int, args) -> str:
    if args.no_mlx_lm:
        return "--no-mlx-lm"
    if n > args.mlx_lm_max_prompt:
        return f"longer than --mlx-lm-max-prompt {args.mlx_lm_max_prompt}"
    return "mlx-lm failed"


def _skip_note(slow: list[int], limit: int, mlx_results: dict[int, dict], machine: dict) -> str:
    lengths = ", ".join(str(n) for n in slow)
    note = f"mlx-lm skipped for length(s) {lengths}: longer than --mlx-lm-max-prompt {limit}"
    if mlx_results:
        n = max(mlx_results)
        rate = mlx_results[n]["prefill_tps"]
        note += (f"; mlx-lm as shipped prefilled {rate:.1f} tok/s here at {n} tokens, so "
                 f"{max(slow)} tokens would take ~{max(slow) / rate / 60:.0f} min")
    elif machine["backend"] == "cpu":
        note += ("; mlx-lm as shipped (quantized weights, MLX's reference BLAS) prefills "
                 "slowly on CPU: ~5-10 tok/s for the 135M default model, so 1000+ tokens "
                 "take minutes")
    return note + " (raise --mlx-lm-max-prompt to run them anyway)"


def _fmt(x: float | None, spec: str = ".1f", suffix: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{suffix}"


def print_report(report: dict) -> None:
    """Print the header, the table and the notes to stdout."""
    m, kv, ml = report["machine"], report["kvchat"], report["mlx_lm"]
    st = report["settings"]
    print(f"kvchat bench: model {report['model']['name']} ({report['model']['model_type']}, "
          f"{report['model']['path']})")
    print(f"machine: {m['cpu']}, {m['cpu_count']} cpus, {m['machine']}, backend {m['backend']}, "
          f"python {m['python']}, mlx {m['mlx']}, mlx-lm {m['mlx_lm']}")
    shim = "on" if kv["gemv_shim"] else "off"
    print(f"kvchat: {kv['weight_format']} weights on {kv['device']}, "
          f"BLAS {kv['blas'] or 'none preloaded (MLX linked BLAS)'} (GEMV shim {shim}), "
          f"in-process, paged KV (block {kv['block_size']}), prefill chunk {kv['prefill_chunk']}")
    if ml:
        libs = ", ".join(ml["blas_libraries"]) or "?"
        print(f"mlx-lm {ml['mlx_lm_version']}: {ml['weight_format']} weights as shipped on "
              f"{ml['device']}, no BLAS preload (MLX links {libs}), separate process, "
              f"generate_step")
    else:
        print("mlx-lm: not run")
    print(f"runs: greedy, EOS ignored, {st['gen_tokens']} decode tokens, "
          f"median of {st['repeats']} run(s); prefill tok/s = prompt / TTFT, "
          f"decode tok/s = (gen - 1) / (last - first token); ratio = kvchat / mlx-lm")
    print()
    header = ["length", "kvchat prefill", "mlx-lm prefill", "ratio", "kvchat decode",
              "mlx-lm decode", "ratio", "kvchat ITL p50/p95 ms", "mlx-lm ITL p50/p95 ms",
              "agree"]
    rows = [header, ["", "tok/s", "tok/s", "", "tok/s", "tok/s", "", "", "", "tokens"]]
    for r in report["results"]:
        k, x = r["kvchat"], r["mlx_lm"]
        skipped = None if x is not None else (
            "failed" if r["mlx_lm_skipped"] == "mlx-lm failed" else "skipped")
        rows.append([
            str(r["length"]),
            _fmt(k["prefill_tps"]),
            skipped or _fmt(x["prefill_tps"]),
            _fmt(r["prefill_ratio"], ".2f", "x"),
            _fmt(k["decode_tps"]),
            skipped or _fmt(x["decode_tps"]),
            _fmt(r["decode_ratio"], ".2f", "x"),
            f"{k['itl_p50_ms']:.1f} / {k['itl_p95_ms']:.1f}",
            skipped or f"{x['itl_p50_ms']:.1f} / {x['itl_p95_ms']:.1f}",
            "-" if r["greedy_agree_tokens"] is None
            else f"{r['greedy_agree_tokens']}/{k['generated_tokens']}",
        ])
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for j, row in enumerate(rows):
        print(" | ".join(c.rjust(w) if j > 1 or i else c.ljust(w)
                         for i, (c, w) in enumerate(zip(row, widths, strict=True))))
        if j == 1:
            print("-+-".join("-" * w for w in widths))
    print()
    print("notes:")
    for note in report["notes"]:
        print(f"  - {note}")
    print("  - agree = leading greedy tokens identical on both sides (weights differ in format)")
