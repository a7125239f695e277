"""The timing shared by both sides of `kvchat bench`, and the mlx-lm worker.

The worker runs mlx-lm the way a user runs it, in a fresh interpreter started by
`app.bench` as ``python -m app.bench_worker --mlx-lm-worker JOB.json``: its own
model code and ``generate_step``, shipped quantized weights, no OpenBLAS preload.
So this module imports only the standard library at top level and never imports
``engine`` (whose import preloads OpenBLAS process-wide).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Iterable
from pathlib import Path

WORKER_FLAG = "--mlx-lm-worker"
WARMUP_GEN_TOKENS = 3


# -- shared by both sides ------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100) of a non-empty list."""
    xs = sorted(values)
    if not xs:
        return 0.0
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def time_stream(prompt_tokens: int, make_tokens) -> dict:
    """Time one generation: ``make_tokens()`` returns an iterator of token ids.

    The clock starts before the iterator is created, so request setup counts
    toward time to first token on both sides alike.
    """
    tic = time.perf_counter()
    stamps: list[float] = []
    tokens: list[int] = []
    for token in make_tokens():
        stamps.append(time.perf_counter())
        tokens.append(int(token))
    if not stamps:
        raise RuntimeError("the generation produced no token")
    ttft = stamps[0] - tic
    decode_s = stamps[-1] - stamps[0]
    itl = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    return {
        "prompt_tokens": prompt_tokens,
        "generated_tokens": len(tokens),
        "ttft_s": ttft,
        "decode_s": decode_s,
        "prefill_tps": prompt_tokens / ttft if ttft > 0 else 0.0,
        "decode_tps": (len(tokens) - 1) / decode_s if decode_s > 0 else 0.0,
        "itl_s": itl,
        "tokens": tokens,
    }


def summarize(runs: list[dict]) -> dict:
    """Median over repeats; ITL percentiles over all repeats' steps pooled."""
    itl = [x for r in runs for x in r["itl_s"]]
    return {
        "prompt_tokens": runs[0]["prompt_tokens"],
        "generated_tokens": runs[0]["generated_tokens"],
        "repeats": len(runs),
        "ttft_s": statistics.median(r["ttft_s"] for r in runs),
        "decode_s": statistics.median(r["decode_s"] for r in runs),
        "prefill_tps": statistics.median(r["prefill_tps"] for r in runs),
        "decode_tps": statistics.median(r["decode_tps"] for r in runs),
        "itl_p50_ms": 1000 * percentile(itl, 50),
        "itl_p95_ms": 1000 * percentile(itl, 95),
        "prefill_tps_runs": [r["prefill_tps"] for r in runs],
        "decode_tps_runs": [r["decode_tps"] for r in runs],
        "tokens": runs[0]["tokens"],
    }


def blas_libraries(only_under: str | None = None) -> list[str]:
    """BLAS/LAPACK libraries mapped into this process (Linux), by file name."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "blas" in line.lower()}
    except OSError:
        return []
    if only_under:
        paths = {p for p in paths if only_under in p}
    return sorted(os.path.basename(p) for p in paths)


def _log(prefix: str, msg: str) -> None:
    print(f"[{prefix}] {msg}", file=sys.stderr, flush=True)


# -- the mlx-lm worker (separate process, never imports engine) ------------------------


def _quant_format(model) -> str:
    bits = sorted({m.bits for _, m in model.named_modules() if hasattr(m, "bits")})
    return "/".join(f"q{b}" for b in bits)


def worker_main(job_file: str) -> int:
    """Run mlx-lm's generate_step over the job's prompts; print one JSON object."""
    # Anything a library prints must not corrupt the JSON on stdout.
    out, sys.stdout = sys.stdout, sys.stderr
    job = json.loads(Path(job_file).read_text())
    if "engine" in sys.modules or "engine.model.blas" in sys.modules:
        raise RuntimeError("the mlx-lm worker must not import kvchat's engine")

    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    _log("mlx-lm", f"loading {job['model_path']} (shipped weights)")
    model, tokenizer = load(job["model_path"])
    gen = job["gen_tokens"]

    def run(ids: list[int], n: int) -> dict:
        def tokens():
            # As stream_generate does, minus its EOS stop: detokenize each token.
            detok = tokenizer.detokenizer
            detok.reset()
            for token, _ in generate_step(mx.array(ids), model, max_tokens=n):
                detok.add_token(token)
                yield token

        return time_stream(len(ids), tokens)

    _log("mlx-lm", "warm-up")
    run(job["warmup_ids"], WARMUP_GEN_TOKENS)
    results = {}
    rate = None  # prefill tok/s seen so far, for a time estimate
    for length, ids in job["prompts"]:
        eta = f", expect ~{length / rate:.0f}s prefill" if rate else ""
        runs = []
        for i in range(job["repeats"]):
            _log("mlx-lm", f"length {length} run {i + 1}/{job['repeats']}{eta}")
            runs.append(run(ids, gen))
        s = summarize(runs)
        rate = s["prefill_tps"]
        _log("mlx-lm", f"length {length}: prefill {s['prefill_tps']:.1f} tok/s, "
                       f"decode {s['decode_tps']:.1f} tok/s")
        results[str(length)] = s
    import mlx_lm

    info = {
        "mlx_lm_version": getattr(mlx_lm, "__version__", "?"),
        "mlx_version": mx.__version__,
        "device": str(mx.default_device().type).rsplit(".", 1)[-1],
        "weight_format": _quant_format(model) or str(
            model.model.embed_tokens.weight.dtype).removeprefix("mlx.core."),
        "blas_preloaded": None,
        "blas_libraries": blas_libraries("mlx"),
        "results": results,
    }
    out.write(json.dumps(info) + "\n")
    out.flush()
    return 0


def _main(argv: Iterable[str]) -> int:
    argv = list(argv)
    if len(argv) == 2 and argv[0] == WORKER_FLAG:
        return worker_main(argv[1])
    print(f"usage: python -m app.bench_worker {WORKER_FLAG} JOB.json (internal; see kvchat bench)",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
