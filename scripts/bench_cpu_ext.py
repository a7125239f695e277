"""Side-by-side figures for the CPU extension (engine/model/cpu_ext), in one run.

    .venv/bin/python scripts/bench_cpu_ext.py [--rounds 3]

1. qmm vs mx.quantized_matmul vs float32 weights on the BLAS, decode and prefill shapes
   of the default model, with qmm's max error against mx.quantized_matmul;
2. paged decode attention: the extension vs the reference (view of a contiguous run for
   one sequence, gather + mask for batches);
3. the default model end to end: float32 weights (today's path) vs the extension path,
   graph nodes and time per decode step at ~128 / ~1k context, engine decode and
   prefill tok/s, weight bytes.

Timings are the best of ``--rounds`` interleaved rounds: the build machines are shared
2-core VMs whose load comes and goes, and the minimum is the figure least disturbed.
"""

from __future__ import annotations

import argparse
import re
import tempfile
import time
from functools import partial

import engine  # noqa: F401  (OpenBLAS before mlx.core)

# isort: split
import mlx.core as mx

from engine import Engine, EngineConfig, SamplingParams, load_model
from engine.executor import build_batch
from engine.model.attention import cpu
from engine.model.attention.reference import paged_attention_ref
from engine.model.cpu_ext import build, ops

TEXT = "The quick brown fox jumps over the lazy dog while the cat sleeps by the fire. " * 400


def best_us(fn, n: int, rounds: int) -> float:
    mx.eval(fn())
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(n):
            mx.eval(fn())
        best = min(best, (time.perf_counter() - t) / n * 1e6)
    return best


def bench_qmm(rounds: int) -> None:
    print("== qmm: us per call (best of rounds); err = max |qmm - mx.quantized_matmul|")
    shapes = [(960, 576, 4, "qkv"), (576, 576, 4, "o_proj"), (3072, 576, 4, "gate_up"),
              (576, 1536, 4, "down"), (49152, 576, 8, "lm_head")]
    for N, K, bits, name in shapes:
        mx.random.seed(N)
        w, s, b = mx.quantize(mx.random.normal((N, K)) * 0.05, group_size=32, bits=bits)
        s, b = s.astype(mx.float16), b.astype(mx.float16)
        wf = mx.dequantize(w, s, b, group_size=32, bits=bits).astype(mx.float32)
        mx.eval(w, s, b, wf)
        for M in (1, 4, 512):
            if name == "lm_head" and M > 4:
                continue
            x = mx.random.normal((M, K))
            mx.eval(x)
            n = 3 if M == 512 or name == "lm_head" else 20
            ref = mx.quantized_matmul(x, w, s, b, transpose=True, group_size=32, bits=bits)
            out = ops.qmm(x, w, s, b, group_size=32, bits=bits)
            err = mx.abs(out - ref).max().item()
            rel = err / max(mx.abs(ref).max().item(), 1e-30)
            t_ext = best_us(partial(ops.qmm, x, w, s, b, group_size=32, bits=bits), n, rounds)
            t_mx = best_us(partial(mx.quantized_matmul, x, w, s, b, transpose=True,
                                   group_size=32, bits=bits), max(1, n // 4), max(1, rounds - 1))
            t_f = best_us(partial(mx.matmul, x, wf.T), n, rounds)
            print(f"{name:8s} {N:5d}x{K:4d} q{bits} M={M:3d}: qmm {t_ext:8.0f}  "
                  f"mx.quantized_matmul {t_mx:9.0f}  f32+BLAS {t_f:8.0f}   "
                  f"err {err:.1e} (rel {rel:.1e})", flush=True)


def bench_attention(rounds: int) -> None:
    print("== paged decode attention (Hq 9, Hkv 3, D 64, block 16): us per call")
    Hq, Hkv, D, bs = 9, 3, 64, 16
    for dtype in (mx.float16, mx.float32):
        for lens in ([128], [1024], [4096], [300, 1000, 50, 700], [1024] * 8):
            nb = sum(-(-n // bs) for n in lens) + 1
            k = mx.random.normal((Hkv, nb, bs, D)).astype(dtype)
            v = mx.random.normal((Hkv, nb, bs, D)).astype(dtype)
            q = mx.random.normal((len(lens), Hq, 1, D))
            width, tables, start = max(-(-n // bs) for n in lens), [], 0
            for n in lens:
                m = -(-n // bs)
                tables.append(list(range(start, start + m)) + [0] * (width - m))
                start += m
            t = mx.array(tables, dtype=mx.int32)
            mx.eval(k, v, q, t)
            run = 0 if len(lens) == 1 else None
            ref = best_us(partial(paged_attention_ref, q, k, v, t, lens, 0.125, block_run=run),
                          20, rounds)
            ext = best_us(partial(cpu.paged_decode, q, k, v, t, lens, 0.125), 20, rounds)
            kind = "view of the run" if run is not None else "gather + mask"
            label = str(lens) if len(lens) < 8 else f"8 x {lens[0]}"
            print(f"{str(dtype)[9:]:8s} {label:22s}: reference ({kind}) {ref:7.0f}  "
                  f"extension {ext:7.0f}", flush=True)


def count_ops(*outs) -> int:
    path = tempfile.mktemp(suffix=".dot")
    mx.export_to_dot(path, *outs)
    with open(path) as f:
        return len(re.findall(r"shape=rectangle", f.read()))


def step_figures(eng: Engine, n_ctx: int, steps: int) -> tuple[int, float]:
    """(graph nodes, best us) of one decode step at ``n_ctx`` tokens of context."""
    ids = eng.loaded.tokenizer.encode(TEXT)[:n_ctx]
    sid = 10_000 + n_ctx
    eng.blocks.allocate(sid)
    for i in range(0, len(ids), 512):
        chunk = ids[i:i + 512]
        plan = eng.blocks.append(sid, len(chunk))
        eng.runner(build_batch(eng.blocks, [sid], mx.array([chunk], dtype=mx.int32),
                               [plan.slots]), eng.kv, logits=False)
        mx.eval(*eng.kv.arrays)
    nodes, best, nxt = 0, float("inf"), 5
    for i in range(steps):
        plan = eng.blocks.append(sid, 1)
        batch = build_batch(eng.blocks, [sid], mx.array([[nxt]], dtype=mx.int32),
                            [plan.slots])
        t = time.perf_counter()
        logits = eng.runner(batch, eng.kv)
        if i == 1:
            nodes = count_ops(logits, *eng.kv.keys, *eng.kv.values)
            t = time.perf_counter()  # exporting the graph is not part of the step
            logits = logits + 0
        y = mx.argmax(logits, axis=-1)
        mx.eval(y, *eng.kv.arrays)
        nxt = int(y.item())
        if i > 1:
            best = min(best, time.perf_counter() - t)
    eng.blocks.free(sid)
    return nodes, best * 1e6


def bench_model(rounds: int) -> None:
    print("== default model: float32 weights (today's path) vs the extension path")
    engines = {}
    for weights in ("float32", "auto"):
        loaded = load_model(weights=weights)
        engines[weights] = Engine(loaded, EngineConfig(kv_budget_bytes=512 << 20,
                                                       prefix_cache=False))
        print(f"{weights:8s}: weight_format {loaded.weight_format}, cpu_ext {loaded.cpu_ext}, "
              f"{loaded.weight_bytes / 1e6:.0f} MB of weights, "
              f"KV {engines[weights].layout.kv_format}")
    for n_ctx in (128, 1024):
        for weights, eng in engines.items():
            nodes, us = step_figures(eng, n_ctx, 12)
            print(f"{weights:8s} ctx {n_ctx:5d}: {nodes:5d} graph nodes per decode step, "
                  f"best {us / 1e3:6.1f} ms per step", flush=True)
    ids = {n: engines["auto"].loaded.tokenizer.encode(TEXT)[:n] for n in (128, 1024)}
    results: dict = {}
    for _ in range(rounds):
        for n, prompt in ids.items():
            for weights, eng in engines.items():
                r = eng.generate_text(prompt, SamplingParams(max_tokens=48, ignore_eos=True))
                dec, pre = results.get((weights, n), (0.0, 0.0))
                results[(weights, n)] = (max(dec, r.stats.decode_tps),
                                         max(pre, r.stats.prefill_tps))
    for (weights, n), (dec, pre) in sorted(results.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        print(f"{weights:8s} prompt {n:5d} tokens: decode {dec:6.1f} tok/s, prefill {pre:6.1f} "
              f"tok/s (best of {rounds})", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", choices=["qmm", "attention", "model"])
    args = parser.parse_args()
    t = time.perf_counter()
    if not build.available():
        raise SystemExit(f"the extension is unavailable: {build.unavailable_reason()}")
    built = build.build_seconds
    print(f"extension: {build.load().simd()}, {build.load().threads()} threads, "
          + (f"built in {built:.1f} s" if built else f"cached ({time.perf_counter() - t:.1f} s)"))
    if args.only in (None, "qmm"):
        bench_qmm(args.rounds)
    if args.only in (None, "attention"):
        bench_attention(args.rounds)
    if args.only in (None, "model"):
        bench_model(args.rounds)


if __name__ == "__main__":
    main()
