"""`kvchat bench load`: the continuous-batching engine under concurrent, mixed load.

Per concurrency C a fresh engine (metrics per level, one loaded model) serves C closed-loop
client threads replaying one seeded workload: short and long prompts (stdlib source token
slices), short and long outputs (EOS ignored), random cancels. A last run repeats the top C
on a deliberately small KV pool (queueing, preemption, ``--oversized`` rejections).
Throughput is generated tokens / wall and decode-step tok/s (tokens of batched decode
forwards / time in them): wall includes prefill, which batching does not speed up on a CPU.
"""

from __future__ import annotations

import gc
import json
import random
import threading
import time
from dataclasses import asdict
from pathlib import Path

from app import arg_types
from app.bench.common import log, machine_info, prompt_ids
from app.bench.load_report import print_report, write_plot
from app.engine_args import add_engine_args, check_kv_budget
from app.engine_config import config_from_args

DEFAULT_PLOT = "bench-results/load.png"
OUTCOMES = ("completed", "cancelled", "rejected", "failed")
DEFAULTS = dict(requests=24, long_prompt=[400, 1000], long_output=[64, 128])  # unless set
QUICK = dict(requests=8, long_prompt=[200, 400], long_output=[32, 48])  # --quick, unless set


def add_parser(sub) -> None:
    """Register ``load`` on the subparsers of the ``bench`` command."""
    p = sub.add_parser("load", help="throughput and latency under concurrent load",
                       description=__doc__.splitlines()[0])
    add_engine_args(p, disk=False)  # RAM prefix cache only: disk I/O is not what is measured
    a, lengths, share = p.add_argument, arg_types.lengths, arg_types.unit_interval
    a("--concurrency", type=lengths, default=[1, 2, 4, 8], help="levels (1,2,4,8)")
    a("--requests", type=arg_types.positive_int, help="requests per level (24; --quick 8)")
    a("--short-prompt", type=lengths, default=[30, 80], help="tokens LO,HI (30,80)")
    a("--long-prompt", type=lengths, help="tokens LO,HI (400,1000; --quick 200,400)")
    a("--long-prompt-rate", type=share, default=0.25, help="share of long prompts (0.25)")
    a("--short-output", type=lengths, default=[16], help="tokens LO,HI (16)")
    a("--long-output", type=lengths, help="tokens LO,HI (64,128; --quick 32,48)")
    a("--long-output-rate", type=share, default=0.4, help="share of long outputs (0.4)")
    a("--cancel-rate", type=share, default=0.1, help="share cancelled after 0..max tokens (0.1)")
    a("--seed", type=arg_types.non_negative_int, default=0, help="workload RNG seed (0)")
    a("--capacity-budget", type=arg_types.size,
      help="capacity run's KV pool (60%% of top C's peak)")
    a("--oversized", type=arg_types.non_negative_int, default=2,
      help="capacity-run requests that never fit (2)")
    a("--no-capacity", action="store_true", help="skip the capacity run")
    a("--quick", action="store_true", help="fewer, shorter requests (about a minute)")
    a("--json", metavar="FILE", default=None, help="write everything to FILE")
    a("--plot", metavar="FILE", help=f"PNG (default: next to --json, else {DEFAULT_PLOT})")
    p.set_defaults(func=run)


def plan_workload(text_ids: list[int], args, rng: random.Random) -> list[dict]:
    """Seeded requests: prompt ids, max tokens and after how many tokens (if ever) to cancel."""
    plan = []
    for _ in range(args.requests):
        r = args.long_prompt if rng.random() < args.long_prompt_rate else args.short_prompt
        n = rng.randint(min(r), max(r))
        start = rng.randrange(0, len(text_ids) - n + 1)  # unrelated prompts share no prefix
        r = args.long_output if rng.random() < args.long_output_rate else args.short_output
        out = rng.randint(min(r), max(r))
        cancel = rng.randrange(0, out) if rng.random() < args.cancel_rate else None
        plan.append(dict(prompt=text_ids[start:start + n], max_tokens=out, cancel_after=cancel))
    return plan


def serve(eng, job: dict) -> dict:
    """Submit one planned request, stream it (cancelling as planned); how it ended."""
    from engine import RequestError, SamplingParams
    rec = dict(prompt_tokens=len(job["prompt"]), max_tokens=job["max_tokens"],
               cancel_after=job["cancel_after"])
    try:
        handle = eng.submit(job["prompt"], SamplingParams(job["max_tokens"], ignore_eos=True))
    except RequestError as e:
        return dict(rec, outcome="rejected", error=str(e))
    tokens, asked, final = 0, False, None
    for final in handle:
        tokens += final.token is not None
        if (not asked and job["cancel_after"] is not None and tokens >= job["cancel_after"]
                and final.finish_reason is None):
            asked = handle.cancel()
    outcome = {"length": "completed", "stop": "completed", "cancelled": "cancelled"}
    return dict(rec, outcome=outcome.get(final.finish_reason, "failed"),
                finish_reason=final.finish_reason, error=final.error, **final.stats.to_dict(),
                itl_ms=[x * 1e3 for x in final.stats.inter_token_s])


def run_level(loaded, config, plan: list[dict], concurrency: int, capacity=False) -> dict:
    """Serve ``plan`` with ``concurrency`` closed-loop clients on a fresh engine."""
    from engine import Engine
    from engine.metrics import Percentiles

    def _pct(xs: list[float]) -> dict:  # nearest rank, like the engine's own metrics
        p = Percentiles.of(xs)
        return dict(p50=p.p50, p95=p.p95, p99=p.p99, max=max(xs, default=0.0), count=p.count)

    eng = Engine(loaded, config)
    jobs, lock, records, waiting_max = iter(plan), threading.Lock(), [], 0

    def client():
        while True:
            with lock:
                job = next(jobs, None)
            if job is None:
                return
            records.append(serve(eng, job))

    eng.start()
    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    while alive := [t for t in threads if t.is_alive()]:
        waiting_max = max(waiting_max, eng.metrics().waiting)  # polled like a dashboard would
        alive[0].join(0.1)
    wall = time.perf_counter() - t0
    m = eng.metrics()  # every client has its final event: every block must be back
    dec = m.decode_forward  # the batched decode forwards alone (+ sampling)
    eng.shutdown()
    ran = [r for r in records if r["outcome"] != "rejected"]
    cancelled = [r for r in records if r["outcome"] == "cancelled"]
    gen = sum(r["generation_tokens"] for r in ran)
    return {
        "concurrency": concurrency, "capacity": capacity, "wall_s": wall,
        "submitted": len(records), **{k: sum(r["outcome"] == k for r in records) for k in OUTCOMES},
        "lost": len(records) - sum(m.finished.values()) - m.rejections,  # the engine's count
        "finish_reasons": m.finished, "generated_tokens": gen,
        "prompt_tokens": sum(r["prompt_tokens"] for r in ran), "gen_tps": gen / wall,
        "decode_phase_tps": sum(max(0, r["generation_tokens"] - 1) for r in ran) / wall,
        "decode_step_tps": dec.tokens_per_s or None,
        "decode_step_s": dec.seconds, "decode_batch_mean": dec.tokens / max(1, dec.steps),
        "requests_per_s": len(ran) / wall,
        "ttft_s": _pct([r["ttft_s"] for r in ran if r["generation_tokens"]]),
        "itl_ms": _pct([x for r in ran for x in r["itl_ms"]]),
        "prefill_tps": _pct([r["prefill_tps"] for r in ran if r["prefill_tps"] > 0]),
        "decode_tps": _pct([r["decode_tps"] for r in ran if r["decode_tps"] > 0]),
        "queue_s": _pct([r["queue_s"] for r in ran]),
        "cancel_release_ms": _pct([r["release_latency_ms"] for r in cancelled]),
        "blocks_released_on_cancel": sum(r["blocks_released"] for r in cancelled),
        "cache": {"budget_bytes": m.budget_bytes, "peak_bytes": m.peak_bytes,
                  "budget_mib": m.budget_bytes / 2**20, "peak_mib": m.peak_bytes / 2**20,
                  "peak_pct": 100 * m.peak_bytes / m.budget_bytes,
                  "peak_blocks": m.peak_bytes // m.bytes_per_block, "blocks_total": m.blocks_total,
                  "blocks_leaked": m.blocks_total - m.blocks_free},
        "pressure": {"waiting_max": waiting_max,
                     "preemptions": m.preemptions, "rejections": m.rejections,
                     "preempted_requests": sum(r["preemptions"] > 0 for r in ran)},
        "engine_metrics": m.to_dict(),
        "requests": [{k: v for k, v in r.items() if k != "itl_ms"} for r in records],
    }


def run(args) -> int:
    """Run the sweep and the capacity run; print the tables, write the plot and the JSON."""
    from engine import Engine, EngineConfig, SamplingParams, load_model

    for k, v in (QUICK if args.quick else DEFAULTS).items():
        setattr(args, k, getattr(args, k) or v)
    base = config_from_args(args)
    check_kv_budget(base.kv_budget_bytes)
    loaded = load_model(args.model, weights=args.weights)
    rng = random.Random(args.seed)
    need = max(4096, 3 * max(args.long_prompt), max(args.short_prompt))
    text = prompt_ids(loaded.tokenizer, [need])[need]
    plan = plan_workload(text, args, rng)
    warm = Engine(loaded, config_from_args(args, kv_budget_bytes=16 << 20))
    for h in [warm.submit(text[:32], SamplingParams(max_tokens=4)) for _ in range(2)]:
        list(h)  # two at once, so the batched decode path is warm too
    levels, results, capacity = sorted(args.concurrency), [], None
    for c in levels:
        config = config_from_args(args, max_running=max(c, EngineConfig().max_running))
        results.append(r := run_level(loaded, config, plan, c))
        gc.collect()  # drop this level's pool before the next one is allocated
        log("load", f"concurrency {c}: {len(plan)} requests in {r['wall_s']:.1f} s")
    if not args.no_capacity:
        bpb, peak = r["engine_metrics"]["bytes_per_block"], r["cache"]["peak_blocks"]  # top C
        longest = -(-max(len(j["prompt"]) + j["max_tokens"] for j in plan) // args.block_size)
        # below the top level's peak, so requests queue and get preempted; the longest still fits
        budget = args.capacity_budget or max(longest + 2, int(0.6 * peak)) * bpb
        cap_plan = list(plan)
        for _ in range(args.oversized):  # prompt + max tokens beyond the pool: never fits
            cap_plan.insert(rng.randrange(len(cap_plan) + 1), dict(
                prompt=text[:32], max_tokens=budget // bpb * args.block_size, cancel_after=None))
        log("load", f"capacity: concurrency {levels[-1]}, KV pool {budget / 2**20:.1f} MiB")
        config = config_from_args(args, kv_budget_bytes=budget, overflow="reject",
                                  max_running=max(levels[-1], EngineConfig().max_running))
        capacity = run_level(loaded, config, cap_plan, levels[-1], capacity=True)
    for r in results + [capacity] * bool(capacity):
        r["vs_base"] = {k: r[k] / results[0][k] if r[k] and results[0][k] else None
                        for k in ("gen_tps", "decode_step_tps", "requests_per_s")}
    plot = Path(args.plot or (Path(args.json).with_suffix(".png") if args.json else DEFAULT_PLOT))
    report = {
        "machine": machine_info(),
        "model": {"name": loaded.name, "path": str(loaded.path), "model_type": loaded.model_type,
                  "fingerprint": loaded.fingerprint, "weight_format": loaded.weight_format},
        "settings": {k: v for k, v in vars(args).items() if k != "func"} | {
            "engine": asdict(base), "base_concurrency": levels[0],
            "prompts": "raw stdlib source token slices; greedy, EOS ignored"},
        "levels": results, "capacity": capacity, "plot": str(plot),
        # the performance issue's check: 8 streams give >= 3x one stream's generated tok/s
        "check": {"top_concurrency": levels[-1], "target_ratio": 3.0,
                  "decode_step_tps_ratio": results[-1]["vs_base"]["decode_step_tps"],
                  "gen_tps_ratio": results[-1]["vs_base"]["gen_tps"]},
    }
    print_report(report)
    write_plot(report, plot)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    log("load", f"wrote {plot}" + (f" and {args.json}" if args.json else ""))
    return 0
