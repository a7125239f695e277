"""`kvchat bench`: cold prefill and decode speed of kvchat next to mlx-lm and llama.cpp.

Every side gets the same raw token ids (no chat template), decodes greedily with
EOS ignored, and is timed by the same code (`common.time_stream`):

- prefill tok/s = prompt tokens / time to first token
- decode tok/s  = (generated tokens - 1) / (first token -> last token)
- inter-token latency (ITL) P50/P95 over the decode steps (nearest rank)

Every prefill is cold, and each run shows it: every length and repeat has its own
text (`app.bench.prompts`), and each engine reports per run how many prompt tokens it
served from a cache (``cached_tokens``), which must be 0. kvchat keys its prefix cache
by a salt that includes the request's tenant, so each run gets a fresh tenant (its
blocks can match nothing), and the disk cache goes to a throwaway directory unless
``--cache-dir`` names one; the count is the engine's own (the request's final stats).
Before each length's timed runs, every side runs one untimed cold prompt of that length
(its own text), as llama-bench warms up at its test's size: a process's first prompt of
a new size pays for its buffers (measured: 195 tok/s against ~245 for the next ones).

kvchat runs in this process (float32 weights + OpenBLAS on CPU). The peers run the
way a user runs them, each in a fresh interpreter (`app.bench.peers`): mlx-lm with its
shipped weights, and with ``--peer llama.cpp`` llama.cpp on the GGUF kvchat's model
comes from. ``--peer llama-bench`` runs llama.cpp's C++ ``llama-bench`` on that file
(`app.bench.llama_bench`: its own random prompts, pp N and tg G at depth N) right after
kvchat's runs of each length.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import tempfile
from pathlib import Path

from app import arg_types
from app.bench.common import load_avg, log, machine_info, summarize, time_stream
from app.bench.compare_report import build_results, print_report, skip_note, warm_runs
from app.bench.llama_bench import LLAMA_BENCH, LlamaBench
from app.bench.peers import LLAMA_CPP, PEER_CHOICES, check_llama_cpp, run_llama_cpp, run_mlx_lm
from app.bench.prompts import DEFAULT_SEED, cold_prompts
from app.bench.worker import WARMUP_GEN_TOKENS
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
                   help="cold runs per length, each on its own prompt; the median is "
                        "reported (1)")
    p.add_argument("--peer", action="append", choices=PEER_CHOICES, default=[],
                   help="also run llama.cpp on the same GGUF: llama.cpp through "
                        "llama-cpp-python on the same token ids (pip install -e '.[peers]'), "
                        "llama-bench: llama.cpp's C++ llama-bench (--llama-cpp-bin)")
    p.add_argument("--llama-cpp-threads", type=arg_types.positive_int, default=None, metavar="N",
                   help="llama.cpp's n_threads and n_threads_batch, llama-bench's -t "
                        "(default: every core)")
    p.add_argument("--llama-cpp-bin", default=None, metavar="DIR",
                   help="where llama-bench is, for --peer llama-bench (default: PATH)")
    p.add_argument("--seed", type=arg_types.non_negative_int, default=DEFAULT_SEED,
                   help=f"seed that picks and orders the prompts' source text ({DEFAULT_SEED})")
    p.add_argument("--mlx-lm-max-prompt", type=arg_types.positive_int, default=1024,
                   help="skip mlx-lm for longer prompts: its CPU prefill with shipped "
                        "quantized weights is slow (1024)")
    p.add_argument("--no-mlx-lm", action="store_true", help="do not run mlx-lm")
    p.add_argument("--json", metavar="FILE", default=None, help="write all results to FILE")
    p.set_defaults(func=run)


def kvchat_run(eng, ids: list[int], n: int, tenant: str) -> dict:
    """One timed kvchat generation, with the cached prompt tokens the engine reported."""
    from engine import SamplingParams

    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    final = []

    def tokens():
        for e in eng.generate(ids, params, tenant=tenant):
            if e.finish_reason == "error":
                raise RuntimeError(f"kvchat's request failed: {e.error}")
            if e.stats is not None:
                final.append(e.stats)
            if e.token is not None:
                yield e.token

    r = time_stream(len(ids), tokens)
    if not final:
        raise RuntimeError("kvchat's request ended without its stats")
    return r | {"cached_tokens": final[-1].cached_tokens, "cache_source": final[-1].cache_source}


def _cache_overrides(args, stack: contextlib.ExitStack) -> dict:
    # Fresh tenants already make every lookup miss; a throwaway directory also keeps the
    # bench's blocks from filling (and evicting) the user's disk cache.
    if getattr(args, "no_disk_cache", False) or getattr(args, "cache_dir", None):
        return {}
    return {"disk_cache_dir": stack.enter_context(
        tempfile.TemporaryDirectory(prefix="kvchat-bench-cache-"))}


def run(args) -> int:
    """Run the benchmark; print the table (stdout) and progress (stderr)."""
    import engine

    peers = sorted(set(args.peer))
    gguf = check_llama_cpp(args.model) if LLAMA_CPP in peers else None  # before the slow part
    lb = LlamaBench.from_args(args) if LLAMA_BENCH in peers else None
    peer_gguf = gguf or (lb.gguf if lb else None)
    lengths = list(args.lengths)
    notes: list[str] = []
    bench_id = secrets.token_hex(6)  # in every tenant: no run can match an earlier one
    with contextlib.ExitStack() as stack:
        log("kvchat", "loading the model")
        eng = build_engine(args, **_cache_overrides(args, stack))
        stack.callback(eng.shutdown)  # before the throwaway cache directory goes
        loaded = eng.loaded
        fits = [n for n in lengths if n + args.gen_tokens <= eng.max_context]
        for n in lengths:
            if n not in fits:
                notes.append(f"length {n} skipped for all: {n} + {args.gen_tokens} tokens "
                             f"exceed the context of {eng.max_context}")
        warmup, drawn = cold_prompts(eng.tokenizer, fits, args.repeats + 1,
                                     block_size=eng.config.block_size,
                                     warmup_tokens=WARMUP_PROMPT_TOKENS, seed=args.seed)
        # each length's first prompt warms that size up, untimed (see the module's doc)
        sized = {n: runs[0] for n, runs in drawn.items()}
        prompts = {n: runs[1:] for n, runs in drawn.items()}
        machine = machine_info()
        log("kvchat", "warm-up")
        kvchat_run(eng, warmup, WARMUP_GEN_TOKENS, f"bench-{bench_id}-warmup")
        sides: dict[str, dict[int, dict]] = {"kvchat": {}, "mlx_lm": {}, "llama_cpp": {}}
        for n in fits:
            kvchat_run(eng, sized[n], WARMUP_GEN_TOKENS, f"bench-{bench_id}-{n}-warmup")
            runs = []
            for i, ids in enumerate(prompts[n]):
                log("kvchat", f"length {n} run {i + 1}/{args.repeats}")
                runs.append(kvchat_run(eng, ids, args.gen_tokens, f"bench-{bench_id}-{n}-{i}"))
            sides["kvchat"][n] = s = summarize(runs)
            log("kvchat", f"length {n}: prefill {s['prefill_tps']:.1f} tok/s, "
                          f"decode {s['decode_tps']:.1f} tok/s, cached tokens "
                          f"{[r['cached_tokens'] for r in s['runs']]}")
            if lb is not None:  # interleaved: each length's peer runs right after kvchat's
                lb.measure(n)
        kvchat_info = {
            "weight_format": loaded.weight_format,
            "matmul": loaded.matmul,
            "device": machine["backend"],
            "blas": engine.model.blas.loaded_path,
            "gemv_shim": engine.model.blas.gemv_shim,
            "block_size": eng.config.block_size,
            "prefill_chunk": eng.config.prefill_chunk,
            "pipelined": eng.executor.pipeline,  # greedy decode steps launched ahead
            # getattr: the engine's options evolve; the report should not break on them.
            "fuse_projections": getattr(eng.config, "fuse_projections", None),
            "prefix_cache": eng.config.prefix_cache,
            "disk_cache": ("off" if not eng.config.disk_cache else
                           "throwaway directory" if not getattr(args, "cache_dir", None)
                           else args.cache_dir),
            "tenants": f"bench-{bench_id}-<length>-<repeat>: one per run",
        }

    status = 0
    infos: dict[str, dict | None] = {"mlx_lm": None, "llama_cpp": None}
    mlx_lengths = [] if args.no_mlx_lm else [n for n in fits if n <= args.mlx_lm_max_prompt]
    if args.no_mlx_lm:
        notes.append("mlx-lm not run (--no-mlx-lm)")
    elif mlx_lengths:
        log("mlx-lm", f"starting a separate process for lengths {mlx_lengths} "
                      "(shipped weights, no OpenBLAS; this is the slow part)")
        try:
            infos["mlx_lm"] = run_mlx_lm(loaded.path, {n: prompts[n] for n in mlx_lengths},
                                         warmup, args.gen_tokens, sized)
        except (RuntimeError, OSError, ValueError) as e:
            notes.append(f"mlx-lm failed: {e}")
            status = 1
    if gguf is not None and fits:
        log("llama.cpp", f"starting a separate process for lengths {fits} ({gguf.name})")
        try:
            infos["llama_cpp"] = run_llama_cpp(gguf, {n: prompts[n] for n in fits}, warmup,
                                               args.gen_tokens, args.llama_cpp_threads, sized)
        except (RuntimeError, OSError, ValueError) as e:
            notes.append(f"llama.cpp failed: {e}")
            status = 1
    for key, info in infos.items():
        sides[key] = {int(k): summarize(runs) for k, runs in (info or {}).get("results",
                                                                             {}).items()}
    sides["llama_bench"] = lb.results if lb else {}
    if lb is not None:
        notes += lb.notes()
        status = 1 if lb.failures else status
    if not args.no_mlx_lm:
        slow = [n for n in fits if n > args.mlx_lm_max_prompt]
        if slow:
            notes.append(skip_note(slow, args.mlx_lm_max_prompt, sides["mlx_lm"], machine))

    machine["load_avg_end"] = load_avg()
    busy = max(x or 0 for x in (machine["load_avg"], machine["load_avg_end"]))
    if busy > (machine["cpu_count"] or 1):
        notes.append(f"the machine was busy: load average up to {busy:.1f} on "
                     f"{machine['cpu_count']} cpus, so other work competed with every side "
                     "(unevenly: engines that spin-wait across threads suffer most)")
    results = build_results(fits, sides, args, peers, notes)
    warm = warm_runs(sides)
    if warm:
        status = 1
        notes.insert(0, f"NOT COLD: {len(warm)} run(s) reported prompt tokens served from a "
                        f"cache, so their prefill figures are not cold prefill: {warm}")
    report = {
        "machine": machine,
        "model": {
            "name": loaded.name,
            "path": str(loaded.path),
            "gguf": str(peer_gguf) if peer_gguf else None,
            "model_type": loaded.model_type,
            "fingerprint": loaded.fingerprint,
        },
        "settings": {
            "lengths": lengths, "gen_tokens": args.gen_tokens, "repeats": args.repeats,
            "peers": ["mlx-lm"] * (not args.no_mlx_lm) + peers, "seed": args.seed,
            "mlx_lm_max_prompt": args.mlx_lm_max_prompt, "greedy": True, "ignore_eos": True,
            "prompt": "raw token ids, no chat template; every length and repeat its own text "
                      "(40-line stdlib source chunks, seeded shuffle, none reused; no two "
                      "prompts share a first block)",
        },
        "cold": {
            "all_cold": not warm,
            "warm_runs": warm,
            "how": "kvchat: a fresh prefix-cache tenant per run (it salts every block hash), "
                   "disk cache in a throwaway directory; mlx-lm: a new prompt cache per run; "
                   "llama.cpp: Llama.reset per run. cached_tokens per run is what each "
                   "engine reported (kvchat: request stats; mlx-lm: cache offset before the "
                   "prompt; llama.cpp: prompt tokens minus those its perf counters evaluated); "
                   "llama-bench: no prompt cache, its KV memory cleared per repetition",
        },
        "kvchat": kvchat_info,
        **{key: None if info is None else {k: v for k, v in info.items() if k != "results"}
           for key, info in infos.items()},
        "llama_bench": lb.info() if lb else None,
        "results": results,
        "notes": notes,
    }
    print_report(report)
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")
        log("kvchat", f"wrote {args.json}")
    return status
