"""`kvchat bench kernel`: every decode attention path, timed per shape (Metal/CUDA).

Paths: the one-pass paged kernel, the two-pass (split-K, GQA-shared) kernel,
MLX's zero-copy view + SDPA (one sequence with contiguous blocks only) and
gather + SDPA (the reference). One row per shape: milliseconds per call of
each path, unique K/V GB/s of the fastest, the path the engine's dispatch
table picks (engine.model.attention.routes.ROUTES) and the fastest.
These figures are what that table should be rebuilt from (``--json``).
Runs only where MLX can run custom kernels; elsewhere it stops with one line.
"""

from __future__ import annotations

import json
import math
import time

from app import arg_types
from engine.errors import KVChatError

# (batch, context) pairs at Llama-3-8B-like heads: 32 q heads, 8 kv heads, D=128.
SHAPES = [(1, 512), (1, 4096), (1, 16384), (1, 32768), (4, 1024), (8, 4096), (16, 2048)]
NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
PATHS = ("one_pass", "two_pass", "view_sdpa", "gather_sdpa")


def add_parser(sub) -> None:
    """Register ``kernel`` on the subparsers of the ``bench`` command."""
    p = sub.add_parser("kernel", help="decode attention paths timed per shape (Metal/CUDA only)",
                       description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    p.add_argument("--block-size", type=arg_types.block_size, default=16)
    p.add_argument("--iters", type=arg_types.positive_int, default=50)
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    p.set_defaults(func=run)


def make_inputs(batch: int, context: int, dtype: str, block_size: int, seed: int,
                num_q_heads: int = NUM_Q_HEADS, num_kv_heads: int = NUM_KV_HEADS,
                head_dim: int = HEAD_DIM) -> dict:
    """Random queries and pools. One sequence: blocks 0, 1, ... in order (so the view
    path applies); several: each sequence's blocks scattered over the pool."""
    import mlx.core as mx
    import numpy as np

    rng = np.random.default_rng(seed)
    mx.random.seed(seed)
    lens = [max(1, context - 7 * i) for i in range(batch)]  # slightly ragged
    needed = [-(-n // block_size) for n in lens]
    ids = np.arange(sum(needed)) if batch == 1 else rng.permutation(sum(needed))
    table = np.zeros((batch, max(needed)), dtype=np.int32)
    start = 0
    for b, k in enumerate(needed):
        table[b, :k] = ids[start:start + k]
        start += k
    dt = getattr(mx, dtype)
    pool = (num_kv_heads, sum(needed), block_size, head_dim)
    return {
        "queries": mx.random.normal((batch, num_q_heads, 1, head_dim)).astype(dt),
        "k_pool": mx.random.normal(pool).astype(dt),
        "v_pool": mx.random.normal(pool).astype(dt),
        "block_tables": mx.array(table),
        "context_lens": lens,
        "scale": 1.0 / math.sqrt(head_dim),
    }


def time_call(fn, inputs: dict, iters: int) -> float:
    """Milliseconds per call after three warm-up calls."""
    import mlx.core as mx

    for _ in range(3):
        mx.eval(fn(**inputs))
    start = time.perf_counter()
    for _ in range(iters):
        mx.eval(fn(**inputs))
    return (time.perf_counter() - start) / iters * 1e3


def path_functions() -> dict:
    """path name -> fn(**inputs), or None where the path does not apply to the inputs."""
    from engine.model.attention.gpu import one_pass, two_pass
    from engine.model.attention.reference import paged_attention_ref

    def view(**inputs):
        return paged_attention_ref(**inputs, block_run=0)

    return {
        "one_pass": lambda inputs: one_pass.paged_decode_attention,
        "two_pass": lambda inputs: two_pass.paged_decode_two_pass,
        "view_sdpa": lambda inputs: view if len(inputs["context_lens"]) == 1 else None,
        "gather_sdpa": lambda inputs: paged_attention_ref,
    }


def measure(shapes, dtype: str, block_size: int, iters: int, paths=PATHS, **heads) -> list[dict]:
    """One row per (batch, context): ms per path (None: not applicable or it failed)."""
    from engine.model.attention import AttentionSpec, PagedCall
    from engine.model.attention.routes import route

    functions = path_functions()
    rows = []
    for batch, context in shapes:
        inputs = make_inputs(batch, context, dtype, block_size, seed=batch, **heads)
        ms: dict[str, float | None] = {}
        for path in paths:
            fn = functions[path](inputs)
            try:
                ms[path] = None if fn is None else time_call(fn, inputs, iters)
            except Exception:  # noqa: BLE001 - report the path as failed, time the rest
                ms[path] = None
        timed = {p: t for p, t in ms.items() if t is not None}
        fastest = min(timed, key=timed.get) if timed else None
        k = inputs["k_pool"]
        unique = sum(inputs["context_lens"]) * k.shape[0] * k.shape[3] * 2 * k.dtype.size
        call = PagedCall(inputs["queries"], k, inputs["v_pool"], inputs["block_tables"],
                         tuple(inputs["context_lens"]), AttentionSpec(inputs["scale"]),
                         0 if batch == 1 else None)
        rows.append({
            "batch": batch, "context": context, "ms": ms, "fastest": fastest,
            "gbps": unique / (timed[fastest] * 1e-3) / 1e9 if fastest else None,
            "route": route(call, "metal").path,  # the GPU rows (Metal and CUDA share them)
        })
    return rows


def format_rows(rows: list[dict], paths=PATHS) -> list[str]:
    """The table as text lines."""
    head = f"{'batch':>5} {'context':>7} " + " ".join(f"{p + ' ms':>14}" for p in paths)
    lines = [head + f" {'K/V GB/s':>9} {'route':>11} {'fastest':>11}"]
    for r in rows:
        cells = " ".join(f"{r['ms'][p]:14.3f}" if r["ms"].get(p) is not None else f"{'-':>14}"
                         for p in paths)
        gbps = f"{r['gbps']:9.1f}" if r["gbps"] else f"{'-':>9}"
        lines.append(f"{r['batch']:5d} {r['context']:7d} {cells} {gbps} {r['route']:>11} "
                     f"{r['fastest'] or '-':>11}")
    return lines


def run(args) -> int:
    """Print the table; a clear error where no custom-kernel back-end exists."""
    from engine.model.backend import kernel_backend

    backend = kernel_backend()
    if backend is None:
        raise KVChatError("bench kernel needs Metal or CUDA: this MLX build runs custom "
                          "kernels on neither (the CPU uses the reference path only)")
    print(f"backend={backend} dtype={args.dtype} block_size={args.block_size} "
          f"heads={NUM_Q_HEADS}/{NUM_KV_HEADS} head_dim={HEAD_DIM}")
    rows = measure(SHAPES, args.dtype, args.block_size, args.iters)
    print("\n".join(format_rows(rows)))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"backend": backend, "dtype": args.dtype, "rows": rows}, f, indent=1)
    return 0
