"""`kvchat bench`: prefill and decode speed of kvchat next to mlx-lm as shipped.

Both sides get the same raw token ids (no chat template), decode greedily with
EOS ignored, and are timed by the same code (`common.time_stream`):

- prefill tok/s = prompt tokens / time to first token
- decode tok/s  = (generated tokens - 1) / (first token -> last token)
- inter-token latency (ITL) P50/P95 over the decode steps (nearest rank)

kvchat runs in this process (float32 weights + OpenBLAS on CPU). mlx-lm runs the
way a user runs it: its own model code and ``generate_step``, the shipped
quantized weights, no OpenBLAS preload. That needs a fresh interpreter (the
preload is process-wide), so it runs as ``python -m app.bench.worker``
(see `app.bench.worker`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from app import arg_types
from app.bench.common import log, machine_info, prompt_ids, summarize, time_stream
from app.bench.compare_report import print_report, skip_note
from app.bench.worker import WARMUP_GEN_TOKENS, WORKER_FLAG
from app.engine_args import add_engine_args, build_engine

WARMUP_PROMPT_TOKENS = 8


def add_arguments(p) -> None:
    """The comparison's flags (on the ``bench`` parser itself)."""
    add_engine_args(p)
    p.add_argument("--lengths", type=arg_types.lengths, default=[128, 1024, 4096],
                   help="prompt lengths in tokens, comma-separated (128,1024,4096)")
    p.add_argument("--gen-tokens", type=arg_types.int_in(2), default=64,
                   help="tokens decoded per run, EOS ignored (64; at least 2)")
    p.add_argument("--repeats", type=arg_types.positive_int, default=1,
                   help="runs per length; the median is reported (1)")
    p.add_argument("--mlx-lm-max-prompt", type=arg_types.positive_int, default=1024,
                   help="skip mlx-lm for longer prompts: its CPU prefill with shipped "
                        "quantized weights is slow (1024)")
    p.add_argument("--no-mlx-lm", action="store_true", help="run kvchat only")
    p.add_argument("--json", metavar="FILE", default=None, help="write all results to FILE")
    p.set_defaults(func=run)


def run_mlx_lm(model_path: Path, prompts: dict[int, list[int]], warmup: list[int],
               gen_tokens: int, repeats: int) -> dict:
    """Run the mlx-lm worker in a fresh interpreter without the OpenBLAS preload."""
    root = Path(__file__).resolve().parents[2]  # the directory holding `app`
    env = dict(os.environ, KVCHAT_BLAS="none")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    job = {"model_path": str(model_path), "gen_tokens": gen_tokens, "repeats": repeats,
           "warmup_ids": warmup, "prompts": [[n, ids] for n, ids in prompts.items()]}
    with tempfile.TemporaryDirectory(prefix="kvchat-bench-") as tmp:
        job_file = Path(tmp) / "job.json"
        job_file.write_text(json.dumps(job))
        # stderr is inherited so the worker's progress shows up live.
        cmd = [sys.executable, "-m", "app.bench.worker", WORKER_FLAG, str(job_file)]
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, env=env, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"the mlx-lm worker exited with status {proc.returncode} "
                           "(its error is above)")
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    if not lines:
        raise RuntimeError("the mlx-lm worker printed no result")
    return json.loads(lines[-1])


def agree(a: list[int], b: list[int]) -> int:
    """How many leading tokens two greedy runs share."""
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
    from engine import SamplingParams

    log("kvchat", "loading the model")
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
    machine = machine_info()

    def kvchat_run(ids: list[int], n: int) -> dict:
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        return time_stream(len(ids), lambda: (e.token for e in eng.generate(ids, params)
                                              if e.token is not None))

    log("kvchat", "warm-up")
    kvchat_run(warmup, WARMUP_GEN_TOKENS)
    kv_results: dict[int, dict] = {}
    for n in fits:
        runs = []
        for i in range(args.repeats):
            log("kvchat", f"length {n} run {i + 1}/{args.repeats}")
            runs.append(kvchat_run(prompts[n], args.gen_tokens))
        kv_results[n] = s = summarize(runs)
        log("kvchat", f"length {n}: prefill {s['prefill_tps']:.1f} tok/s, "
                      f"decode {s['decode_tps']:.1f} tok/s")

    mlx_info: dict | None = None
    mlx_lengths = [] if args.no_mlx_lm else [n for n in fits if n <= args.mlx_lm_max_prompt]
    status = 0
    if args.no_mlx_lm:
        notes.append("mlx-lm not run (--no-mlx-lm)")
    elif mlx_lengths:
        log("mlx-lm", f"starting a separate process for lengths {mlx_lengths} "
                      "(shipped weights, no OpenBLAS; this is the slow part)")
        try:
            mlx_info = run_mlx_lm(loaded.path, {n: prompts[n] for n in mlx_lengths}, warmup,
                                  args.gen_tokens, args.repeats)
        except (RuntimeError, OSError, ValueError) as e:
            notes.append(f"mlx-lm failed: {e}")
            status = 1
    mlx_results = {int(k): summarize(runs)
                   for k, runs in (mlx_info or {}).get("results", {}).items()}
    if not args.no_mlx_lm:
        slow = [n for n in fits if n > args.mlx_lm_max_prompt]
        if slow:
            notes.append(skip_note(slow, args.mlx_lm_max_prompt, mlx_results, machine))

    for n in fits:
        if n in mlx_results:
            for side, s in (("kvchat", kv_results[n]), ("mlx-lm", mlx_results[n])):
                if s["generated_tokens"] != args.gen_tokens:
                    notes.append(f"length {n}: {side} decoded {s['generated_tokens']} tokens, "
                                 f"not {args.gen_tokens}")

    results = []
    for n in fits:
        kv, ml = kv_results[n], mlx_results.get(n)
        results.append({
            "length": n,
            "kvchat": _public(kv),
            "mlx_lm": _public(ml),
            "mlx_lm_skipped": None if ml else _skip_reason(n, args),
            "prefill_ratio": kv["prefill_tps"] / ml["prefill_tps"] if ml else None,
            "decode_ratio": kv["decode_tps"] / ml["decode_tps"] if ml else None,
            "greedy_agree_tokens": agree(kv["tokens"], ml["tokens"]) if ml else None,
        })

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
    eng.shutdown()
    print_report(report)
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")
        log("kvchat", f"wrote {args.json}")
    return status


def _skip_reason(n: int, args) -> str:
    if args.no_mlx_lm:
        return "--no-mlx-lm"
    if n > args.mlx_lm_max_prompt:
        return f"longer than --mlx-lm-max-prompt {args.mlx_lm_max_prompt}"
    return "mlx-lm failed"
