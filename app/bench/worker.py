"""The mlx-lm side of `kvchat bench`, in its own interpreter.

Started by `app.bench.compare` as ``python -m app.bench.worker --mlx-lm-worker JOB.json``,
it runs mlx-lm the way a user runs it: its own model code and ``generate_step``,
shipped quantized weights, no OpenBLAS preload. So it never imports ``engine``
(whose import preloads OpenBLAS process-wide) and sends raw timed runs back; the
parent summarizes both sides with the same code.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from collections.abc import Iterable
from pathlib import Path

from app.bench.common import log, time_stream

WORKER_FLAG = "--mlx-lm-worker"
WARMUP_GEN_TOKENS = 3


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
    from mlx_lm.models.cache import make_prompt_cache

    log("mlx-lm", f"loading {job['model_path']} (shipped weights)")
    model, tokenizer = load(job["model_path"])
    gen = job["gen_tokens"]

    def run(ids: list[int], n: int) -> dict:
        # A new prompt cache per run, as generate_step makes when given none; passing it
        # in lets the run report what it held before the prompt (0: a cold prefill).
        cache = make_prompt_cache(model)
        cached = max((getattr(c, "offset", 0) for c in cache), default=0)

        def tokens():
            # As stream_generate does, minus its EOS stop: detokenize each token.
            detok = tokenizer.detokenizer
            detok.reset()
            for token, _ in generate_step(mx.array(ids), model, max_tokens=n,
                                          prompt_cache=cache):
                detok.add_token(token)
                yield token

        return time_stream(len(ids), tokens) | {"cached_tokens": int(cached)}

    log("mlx-lm", "warm-up")
    run(job["warmup_ids"], WARMUP_GEN_TOKENS)
    results = {}
    rate = None  # prefill tok/s seen so far, for a time estimate
    for length, repeats, *sized in job["prompts"]:  # one independent prompt per repeat
        if sized:  # this size's untimed warm-up, as kvchat's
            run(sized[0], WARMUP_GEN_TOKENS)
        eta = f", expect ~{length / rate:.0f}s prefill" if rate else ""
        runs = []
        for i, ids in enumerate(repeats):
            log("mlx-lm", f"length {length} run {i + 1}/{len(repeats)}{eta}")
            runs.append(run(ids, gen))
        rate = statistics.median(r["prefill_tps"] for r in runs)
        log("mlx-lm", f"length {length}: prefill {rate:.1f} tok/s, decode "
                      f"{statistics.median(r['decode_tps'] for r in runs):.1f} tok/s")
        results[str(length)] = runs  # raw: the parent summarizes every side alike
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
    print(f"usage: python -m app.bench.worker {WORKER_FLAG} JOB.json (internal; see kvchat bench)",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
