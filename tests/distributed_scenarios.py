"""Scenarios run by every rank of a local multi-process run (`tests/test_distributed.py`,
`scripts/distributed_check.sh`). Rank 0 prints one JSON object on stdout.

    python tests/distributed_scenarios.py SCENARIO --model DIR [--mode MODE[:SPLIT],...]

MODE is pipeline or tensor, SPLIT layers per rank as 1/2; one run per item, over the same ranks.
An item may end in @q4-kivi: that run's pool is the residual 4-bit format (per-channel keys).

- parity: greedy tokens of a few prompts (one decoding alone, then a batch of them) on the
  ranks vs one process over the same weights (rank 0 runs both); then a long generation
  cancelled mid-stream, with every rank's pool report before and after; the final reports.
- disk: one fresh engine per --mode item (empty RAM cache) over the same disk stores, each
  answering the same prompt: a repeat of a split restores its prefix from disk on every rank,
  another split misses (every rank's entries are keyed by its part of the model).
- stream: rank 0 generates without end (after printing {"started": ...}), for a test to
  kill rank 1; with --stall-after N rank 1 stops answering (SIGSTOP) after N forwards.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import engine  # noqa: E402,F401  (preloads OpenBLAS before mlx.core)
from engine import Engine, EngineConfig, SamplingParams, load_model  # noqa: E402
from engine.distributed import ParallelConfig, init_group  # noqa: E402

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
           "List three prime numbers greater than 100."]


def greedy(eng, ids_list, max_tokens, *, batch: bool):
    params = SamplingParams(max_tokens=max_tokens)
    if not batch:
        return [eng.generate_text(ids, params).tokens for ids in ids_list]
    handles = [eng.submit(ids, params) for ids in ids_list]
    out = []
    for h in handles:
        toks = [e.token for e in h if e.token is not None]
        out.append(toks)
    return out


def reference(args, config) -> dict:
    """One process over the whole model: the tokens (and time) to match."""
    ref = Engine(load_model(args.model, weights=args.weights), config)
    ids = [ref.encode_prompt(p) for p in PROMPTS]
    t = time.perf_counter()
    one = greedy(ref, ids[:1], args.max_tokens, batch=False)
    one_s = time.perf_counter() - t
    out = dict(ids=ids, one=one, batch=greedy(ref, ids, args.max_tokens, batch=True),
               bytes_per_token=ref.layout.bytes_per_token, one_s=one_s)
    ref.shutdown()
    return out


def cancel_mid_stream(eng) -> dict:
    """A long generation cancelled after 5 tokens; every rank's report before and after."""
    h = eng.submit(eng.encode_prompt(PROMPTS[1]), SamplingParams(max_tokens=10_000))
    seen, during, finish = 0, None, None
    for e in h:
        seen += e.token is not None
        if seen == 5 and during is None:
            during = [r.to_dict() for r in eng.rank_reports()]
            eng.cancel(h.request_id)
        if e.finish_reason:
            finish = e.finish_reason
            break
    after = [r.to_dict() for r in eng.rank_reports()]
    return dict(finish=finish, tokens=seen, during=during, after=after)


def distributed(args, group, parallel, config, ref) -> dict:
    """The reference's prompts on the ranks, then a cancel mid-stream."""
    from engine.distributed.engine import DistributedEngine

    eng = DistributedEngine(load_model(args.model, weights=args.weights), config, group,
                            parallel)
    t = time.perf_counter()
    one = greedy(eng, ref["ids"][:1], args.max_tokens, batch=False)
    one_s = time.perf_counter() - t
    batch = greedy(eng, ref["ids"], args.max_tokens, batch=True)
    cancelled = cancel_mid_stream(eng)
    eng.shutdown()
    return dict(want_one=ref["one"], got_one=one, want_batch=ref["batch"], got_batch=batch,
                ref_bytes_per_token=ref["bytes_per_token"], ref_one_s=ref["one_s"],
                dist_one_s=one_s, cancel=cancelled, notices=eng.notices,
                final=[r.to_dict() for r in eng.final_reports])


KV_FORMATS = {"": {}, "q4-kivi": dict(k_bits=4, v_bits=4, kv_group_size=32, kv_residual=True,
                                        kv_key_channel=True)}


def item_config(config, item: str) -> tuple[str, EngineConfig]:
    """(a --mode item's KV format after its @, ``config`` with that format)."""
    fmt = item.partition("@")[2]
    return fmt, dataclasses.replace(config, **KV_FORMATS[fmt])


def parity(args, group, parallels, config) -> dict:
    """One reference per KV format, then each --mode item in turn over the same ranks."""
    out, refs = {}, {}
    for item, p in zip(args.mode.split(","), parallels, strict=True):
        fmt, cfg = item_config(config, item)
        if fmt not in refs:
            refs[fmt] = reference(args, cfg)
        out[p.mode + (f"@{fmt}" if fmt else "")] = distributed(args, group, p, cfg, refs[fmt])
    return out


def disk(args, group, parallels, config) -> dict:
    """The same prompt on a fresh engine per parallel layout, over the same disk stores."""
    from engine.distributed.engine import DistributedEngine

    phases = []  # rank 1 drops its own store before run --forget-rank1-at (see main)
    for item, parallel in zip(args.mode.split(","), parallels, strict=True):
        _, cfg = item_config(config, item)
        eng = DistributedEngine(load_model(args.model, weights=args.weights), cfg, group,
                                parallel)
        ids = eng.encode_prompt(PROMPTS[2] + " Then explain why each one is prime.")
        r = eng.generate_text(ids, SamplingParams(max_tokens=args.max_tokens))
        eng.shutdown()
        phases.append(dict(mode=parallel.mode, split=parallel.split, tokens=r.tokens,
                           source=r.stats.cache_source, cached=r.stats.cached_tokens,
                           prompt=len(ids), final=[x.to_dict() for x in eng.final_reports]))
    return {"phases": phases}


def stream(args, group, parallels, config) -> dict:
    from engine.distributed.engine import DistributedEngine

    eng = DistributedEngine(load_model(args.model, weights=args.weights), config, group,
                            parallels[0])
    ids = eng.encode_prompt(PROMPTS[0])
    print(json.dumps({"started": time.time()}), flush=True)
    eng.generate_text(ids, SamplingParams(max_tokens=10_000))  # rank 1 is lost before the end
    return {"unexpected": "finished"}


def stop_after(worker, steps: int) -> None:
    """Make ``worker`` stop dead (SIGSTOP, as a hung Mac would) after ``steps`` forwards."""
    forward, n = worker._forward, [0]

    def stalling(msg):
        n[0] += 1
        if n[0] > steps:
            os.kill(os.getpid(), signal.SIGSTOP)
        forward(msg)

    worker._forward = stalling


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("scenario", choices=["parity", "disk", "stream"])
    p.add_argument("--model", required=True)
    p.add_argument("--weights", default="float32")
    p.add_argument("--mode", default="pipeline", help="pipeline, tensor or both: a,b")
    p.add_argument("--disk-dir", default=None, help="the disk prefix store (rank 0's)")
    p.add_argument("--forget-rank1-at", type=int, default=None,
                   help="disk: delete rank 1's store before this run (0-based)")
    p.add_argument("--timeout", type=float, default=30.0)
    p.add_argument("--max-tokens", type=int, default=12)
    p.add_argument("--stall-after", type=int, default=None)
    args = p.parse_args()
    parallels = []
    for item in args.mode.split(","):
        mode, _, split = item.partition("@")[0].partition(":")
        parallels.append(ParallelConfig(
            mode=mode, split=tuple(int(n) for n in split.split("/")) if split else None,
            timeout_s=args.timeout, init_timeout_s=120))
    group = init_group("ring", timeout_s=120)
    config = EngineConfig(kv_budget_bytes=64 << 20, prefill_chunk=64,
                          disk_cache=args.disk_dir is not None, disk_cache_dir=args.disk_dir)
    if group.rank() != 0:
        from engine.distributed.prefix import rank_store_dir
        from engine.distributed.worker import Worker

        for k, parallel in enumerate(parallels):  # one run per mode, over the same ranks
            if k == args.forget_rank1_at:
                # rank 1 loses its store (rank 0 keeps its own). Rank 1 deletes it itself,
                # between its runs: from rank 0 it raced the last run's final writes
                shutil.rmtree(rank_store_dir(args.disk_dir, group.rank()))
            worker = Worker(load_model(args.model, weights=args.weights), config, group,
                            parallel)
            if args.stall_after is not None:
                stop_after(worker, args.stall_after)
            status = worker.serve()
        return status
    run = {"parity": parity, "disk": disk, "stream": stream}[args.scenario]
    out = run(args, group, parallels, config)
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
