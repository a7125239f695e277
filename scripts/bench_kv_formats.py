"""Decode on a float16 vs a quantized KV pool at a long context, side by side in one run.

    .venv/bin/python scripts/bench_kv_formats.py [--ctx 4096] [--rounds 3] [--gen 32]
        [--only kernel|prefill|step|decode|ttft]
        [--formats f16,q8,k8v4,q4,q8-kivi,k8v4-kivi,q4-kivi]
        [--streams N]

1. kernel: the CPU extension's paged decode attention alone (Hq 9, Hkv 3, D 64, one
   sequence of --ctx tokens), us per layer call, with and without the rotation of queries
   and outputs (`attention.paged_attention`, what a layer runs);
2. prefill: the extension's prefill attention alone (same heads), a chunk of 15 and one of
   512 queries ending at --ctx tokens, us per layer call, and the pool write of the chunk;
3. step: the default model's decode step at --ctx tokens of context, one engine per
   format: graph nodes and ms per step (best of the interleaved rounds);
4. decode: engine decode tok/s (``Engine.generate``, the prompt served from the prefix
   cache after the first round), --gen tokens, interleaved rounds, best and median; with
   --streams N, N sequences of --ctx tokens (each its own blocks) decoding together, their
   generated tokens over the wall time;
5. ttft: time to first token of a --ctx + 15-token prompt on a fresh engine per format:
   cold, then the same prompt again (its full blocks from the prefix cache in RAM, the
   last 15 tokens prefilled again), each round.

Every section measures the formats interleaved, round after round: the build machines are
shared 2-core VMs, and only figures taken side by side compare. The load average is printed.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import tempfile
import time
from functools import partial

import engine  # noqa: F401  (OpenBLAS before mlx.core)

# isort: split
import mlx.core as mx

from engine import Engine, EngineConfig, SamplingParams, load_model
from engine.executor import build_batch
from engine.generation import collect
from engine.kvcache.kv_cache import KVLayout, PagedKVCache
from engine.kvcache.quant import QuantSpec
from engine.kvcache.residual import ResidualKVCache
from engine.model import memory
from engine.model.attention import cpu, cpu_residual
from engine.model.attention.dispatch import paged_attention
from engine.model.cpu_ext import build, ops

FORMATS = {"f16": (16, 16), "q8": (8, 8), "k8v4": (8, 4), "q4": (4, 4), "q8-plain": (8, 8),
           "q8-kivi": (8, 8), "k8v4-kivi": (8, 4), "q4-kivi": (4, 4)}
TEXT = "The quick brown fox jumps over the lazy dog while the cat sleeps by the fire. " * 900


def load() -> str:
    return "load average {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())


def count_ops(*outs) -> int:
    path = tempfile.mktemp(suffix=".dot")
    mx.export_to_dot(path, *outs)
    with open(path) as f:
        return len(re.findall(r"shape=rectangle", f.read()))


def best_us(fn, n: int) -> float:
    """The fastest of n calls (the least disturbed on a shared machine)."""
    best = float("inf")
    for _ in range(n):
        t = time.perf_counter()
        mx.eval(fn())
        best = min(best, time.perf_counter() - t)
    return best * 1e6


def _quant(bits: int, name: str) -> QuantSpec | None:
    return None if bits == 16 else QuantSpec(bits, 64, 0 if name.endswith("plain") else 1)


def bench_kernel(names: list[str], ctx: int, rounds: int) -> None:
    print(f"== paged decode attention, 1 x {ctx} tokens (Hq 9, Hkv 3, D 64, block 16): "
          f"us per layer call, best of {rounds} interleaved rounds ({load()})")
    Hq, Hkv, D, bs = 9, 3, 64, 16
    nb = ctx // bs + 1
    table = mx.array([list(range(1, nb))], dtype=mx.int32)
    slots = mx.arange(bs, nb * bs, dtype=mx.int32)
    mx.random.seed(0)
    rows_k = mx.random.normal((Hkv, len(slots), D)).astype(mx.float16)
    rows_v = mx.random.normal((Hkv, len(slots), D)).astype(mx.float16)
    q = mx.random.normal((1, Hq, 1, D)).astype(mx.float32)
    cases = {}
    for name in names:
        kb, vb = FORMATS[name]
        kivi = name.endswith("-kivi")  # residual, keys per channel (`kvcache.residual`)
        layout = KVLayout(1, Hkv, D, bs, mx.float16, _quant(kb, name), _quant(vb, name),
                          residual=kivi, key_channel=kivi)
        cache = (ResidualKVCache(layout, nb) if kivi else
                 PagedKVCache(layout, nb, ops.kv_write, quant_writer=ops.kv_write_quant))
        # the last row apart, as a decode step writes it: a residual pool's blocks that
        # fill in a write are still read exact in that step (`kvcache.residual`)
        cache.write(0, slots[:-1], rows_k[:, :-1], rows_v[:, :-1])
        cache.write(0, slots[-1:], rows_k[:, -1:], rows_v[:, -1:])
        mx.eval(*cache.arrays)
        k, v = cache.block_view(0)
        kernel = cpu_residual.launch if kivi else cpu.paged_decode
        cases[name] = (partial(kernel, q, k, v, table, [ctx], 0.125),
                       partial(paged_attention, q, k, v, table, [ctx], 0.125))
    best: dict = {}
    for _ in range(rounds):
        for name, fns in cases.items():
            for i, fn in enumerate(fns):
                mx.eval(fn())
                us = best_us(fn, 50)
                best[name, i] = min(best.get((name, i), float("inf")), us)
    for name in cases:
        print(f"{name:9s}: kernel {best[name, 0]:6.0f} us   with the rotation "
              f"{best[name, 1]:6.0f} us", flush=True)


def _prefill_case(name: str, L: int, ctx: int, rows: list[mx.array]) -> tuple[float, float]:
    """us of one prefill attention call (best of 5) of L queries ending at ctx, and of the
    chunk's pool write, on a fresh pool (a residual pool never rewrites a quantized block)."""
    Hq, Hkv, D, bs = 9, 3, 64, 16
    nb = -(-ctx // bs) + 1
    kb, vb = FORMATS[name]
    kivi = name.endswith("-kivi")
    layout = KVLayout(1, Hkv, D, bs, mx.float16, _quant(kb, name), _quant(vb, name),
                      residual=kivi, key_channel=kivi)
    writers = dict(quant_writer=ops.kv_write_quant)  # the engine's, as `wiring` gives them
    cache = (ResidualKVCache(layout, nb, ops.kv_write, channel_quant=ops.channel_quant,
                             **writers) if kivi else
             PagedKVCache(layout, nb, ops.kv_write, **writers))
    for lo, hi in ((0, ctx - L), (ctx - L, ctx)):  # the chunk's write timed
        t = time.perf_counter()
        cache.write(0, mx.arange(lo, hi, dtype=mx.int32), *(r[:, lo:hi] for r in rows))
        mx.eval(*cache.arrays)
        wrote = (time.perf_counter() - t) * 1e6
    k, v = cache.block_view(0)
    kernel = cpu_residual.launch if kivi else cpu.paged_prefill
    table = mx.array([list(range(nb))], dtype=mx.int32)
    fn = partial(kernel, mx.random.normal((1, Hq, L, D)), k, v, table, [ctx], 0.125)
    mx.eval(fn())
    return best_us(fn, 5), wrote


def bench_prefill(names: list[str], ctx: int, rounds: int) -> None:
    print(f"== paged prefill attention, a chunk ending at {ctx} tokens (Hq 9, Hkv 3, D 64, "
          f"block 16): ms per layer call and for the chunk's pool write, best of {rounds} "
          f"interleaved rounds ({load()})")
    mx.random.seed(0)
    rows = [mx.random.normal((3, ctx, 64)).astype(mx.float16) for _ in range(2)]
    best: dict = {}
    with memory.prefill_scratch_on_cpu():  # the heap as the engine's prefill steps have it
        for _ in range(rounds):
            for name in names:
                for L in (15, 512):
                    for i, us in enumerate(_prefill_case(name, L, ctx, rows)):
                        best[name, L, i] = min(best.get((name, L, i), float("inf")), us)
    for name in names:
        for L in (15, 512):
            print(f"{name:9s} {L:3d} queries: attention {best[name, L, 0] / 1e3:6.2f} ms, "
                  f"write {best[name, L, 1] / 1e3:5.2f} ms", flush=True)


def engines(names: list[str], ctx: int, streams: int = 1) -> dict[str, Engine]:
    out = {}
    loaded = load_model()
    for name in names:
        kb, vb = FORMATS[name]
        kivi = name.endswith("-kivi")
        cfg = EngineConfig(kv_budget_bytes=((streams + 1) * ctx * 23_040 + (64 << 20)), k_bits=kb,
                           v_bits=vb, kv_rotation=not name.endswith("plain"),
                           kv_residual=kivi, kv_key_channel=kivi)
        out[name] = Engine(loaded, cfg)
        print(f"{name:9s}: KV {out[name].layout.kv_format}", flush=True)
    return out


def bench_step(engs: dict[str, Engine], ctx: int, rounds: int) -> None:

    print(f"== decode step at {ctx} tokens of context: graph nodes, ms per step "
          f"(best and median of {rounds} interleaved rounds of 8 steps; {load()})")
    ids = next(iter(engs.values())).loaded.tokenizer.encode(TEXT)[:ctx]
    state = {}
    for name, eng in engs.items():
        sid = 777
        eng.blocks.allocate(sid)
        for i in range(0, len(ids), 512):
            chunk = ids[i:i + 512]
            plan = eng.blocks.append(sid, len(chunk))
            eng.runner(build_batch(eng.blocks, [sid], mx.array([chunk], dtype=mx.int32),
                                   [plan.slots]), eng.kv, logits=False)
            mx.eval(*eng.kv.arrays)
        state[name] = [sid, 5, 0, []]

    def step(name: str, eng: Engine, count: bool) -> float:
        sid, nxt = state[name][:2]
        plan = eng.blocks.append(sid, 1)
        batch = build_batch(eng.blocks, [sid], mx.array([[nxt]], dtype=mx.int32), [plan.slots])
        t = time.perf_counter()
        logits = eng.runner(batch, eng.kv)
        if count:
            state[name][2] = count_ops(logits, *eng.kv.keys, *eng.kv.values)
            t = time.perf_counter()
            logits = logits + 0
        y = mx.argmax(logits, axis=-1)
        mx.eval(y, *eng.kv.arrays)
        state[name][1] = int(y.item())
        return time.perf_counter() - t

    for name, eng in engs.items():
        step(name, eng, True)
    for _ in range(rounds):
        for name, eng in engs.items():
            step(name, eng, False)
            state[name][3] += [step(name, eng, False) for _ in range(8)]
    best = {name: min(st[3]) for name, st in state.items()}
    med = {name: statistics.median(st[3]) for name, st in state.items()}
    first = next(iter(engs))
    for name, (sid, _, nodes, _) in state.items():
        engs[name].blocks.free(sid)
        print(f"{name:9s}: {nodes:5d} graph nodes, best {best[name] * 1e3:6.2f} ms per step "
              f"({best[first] / best[name]:.2f}x the first), median {med[name] * 1e3:6.2f} "
              f"({med[first] / med[name]:.2f}x)", flush=True)


def bench_decode(engs: dict[str, Engine], ctx: int, gen: int, rounds: int,
                 streams: int = 1) -> None:
    print(f"== engine decode tok/s, {ctx}-token prompt (prefix-cached after the first "
          f"round), {gen} tokens, {streams} stream(s), {rounds} interleaved rounds ({load()})")
    ids = next(iter(engs.values())).loaded.tokenizer.encode(TEXT)[:ctx - 1]
    # each stream its own context: a distinct first token makes every block of it distinct
    prompts = [[1000 + i] + ids for i in range(streams)]
    params = SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True)
    tps: dict[str, list[float]] = {name: [] for name in engs}
    wall: dict[str, list[float]] = {name: [] for name in engs}
    for eng in engs.values():  # the cold prefills, not timed
        for p in prompts:
            eng.generate_text(p, SamplingParams(max_tokens=2, ignore_eos=True), tenant="b")
    for _ in range(rounds):
        for name, eng in engs.items():
            if streams == 1:
                tps[name].append(eng.generate_text(prompts[0], params, tenant="b").stats.decode_tps)
                continue
            # all streams together: the sum of their decode rates (first to last token), and
            # generated tokens over the wall time, which also holds the prompts' uncached
            # tails (the residual formats re-prefill part of a cached prompt's last block)
            t = time.perf_counter()
            results = [collect(h) for h in [eng.submit(p, params, tenant="b") for p in prompts]]
            wall[name].append(sum(len(r.tokens) for r in results) / (time.perf_counter() - t))
            tps[name].append(sum(r.stats.decode_tps for r in results))
    if streams > 1:
        w0 = max(wall[next(iter(engs))])
        for name, xs in wall.items():
            print(f"{name:9s}: wall clock best {max(xs):6.1f} tok/s ({max(xs) / w0:.2f}x the "
                  f"first), median {statistics.median(xs):6.1f}", flush=True)
    base = max(tps[next(iter(engs))])
    for name, xs in tps.items():
        print(f"{name:9s}: best {max(xs):6.1f} tok/s ({max(xs) / base:.2f}x the first), "
              f"median {statistics.median(xs):6.1f}", flush=True)
    print(f"({load()})")


def bench_ttft(names: list[str], ctx: int, rounds: int) -> None:
    print(f"== time to first token, a {ctx + 15}-token prompt, a fresh engine per format: "
          f"cold, then again from the prefix cache; {rounds} interleaved rounds ({load()})")
    loaded = load_model()
    ids = loaded.tokenizer.encode(TEXT)[:ctx + 15]
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for r in range(rounds):
        for name, eng in engines(names, ctx).items():
            prompt = [1000 + r] + ids[1:]  # a new first token each round: nothing cached
            times = []
            for _ in range(3):
                t = time.perf_counter()
                eng.generate_text(prompt, params)
                times.append(time.perf_counter() - t)
            print(f"{name:9s} round {r}: cold {times[0]:6.2f} s, cached {times[1] * 1e3:6.1f} "
                  f"/ {times[2] * 1e3:6.1f} ms", flush=True)
            eng.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ctx", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--gen", type=int, default=32)
    p.add_argument("--only", choices=["kernel", "prefill", "step", "decode", "ttft"])
    p.add_argument("--formats", default="f16,q8,k8v4,q4")
    p.add_argument("--streams", type=int, default=1,
                   help="decode: this many sequences of --ctx tokens each, decoding together")
    args = p.parse_args()
    if not build.available():
        raise SystemExit(f"the extension is unavailable: {build.unavailable_reason()}")
    names = args.formats.split(",")
    if args.only in (None, "kernel"):
        bench_kernel(names, args.ctx, args.rounds)
    if args.only in (None, "prefill"):
        bench_prefill(names, args.ctx, args.rounds)
    if args.only == "ttft":
        bench_ttft(names, args.ctx, args.rounds)
    if args.only in ("step", "decode", None):
        engs = engines(names, args.ctx, args.streams)
        if args.only in (None, "step"):
            bench_step(engs, args.ctx, args.rounds)
        if args.only in (None, "decode"):
            bench_decode(engs, args.ctx, args.gen, args.rounds, args.streams)
        for eng in engs.values():
            eng.shutdown()


if __name__ == "__main__":
    main()
