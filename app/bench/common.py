"""What every benchmark shares: progress lines, the machine, prompt token ids, timing.

Only the standard library at top level: the mlx-lm worker imports this module and
must never import ``engine`` (whose import preloads OpenBLAS process-wide).
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterable


def log(prefix: str, msg: str) -> None:
    """One progress line on stderr (stdout is for the report)."""
    print(f"[{prefix}] {msg}", file=sys.stderr, flush=True)


def _total_ram_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def load_avg() -> float | None:
    """The 1-minute load average: above the core count, other work competed for the CPUs."""
    try:
        return round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):
        return None


def machine_info() -> dict:
    """Platform, CPU, RAM, backend, BLAS and library versions, for a report's header."""
    import importlib.metadata

    from engine.model import backend, blas

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
        "ram_bytes": _total_ram_bytes(),
        "load_avg": load_avg(),  # when the report began; the bench adds load_avg_end
        "python": platform.python_version(),
        "backend": backend.backend(),
        "blas": blas.loaded_path,  # kvchat's preloaded BLAS (None: MLX's linked one)
        "mlx": version("mlx"),
        "mlx_lm": version("mlx-lm"),
        "llama_cpp_python": version("llama-cpp-python"),
    }


def prompt_text() -> str:
    """A long, deterministic natural text: the source of two stdlib modules."""
    import argparse
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


def time_stream(prompt_tokens: int, make_tokens: Callable[[], Iterable[int]]) -> dict:
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


# What each repeat keeps in the JSON (the ITL list and token ids would bloat it).
RUN_FIELDS = ("prompt_tokens", "cached_tokens", "generated_tokens", "ttft_s", "prefill_tps",
              "decode_tps")


def summarize(runs: list[dict]) -> dict:
    """Median over repeats; ITL percentiles over all repeats' steps pooled.

    Percentiles are nearest rank (`engine.metrics.Percentiles`), the engine's own
    definition, so bench, bench load and the TUI panel report the same statistic.
    ``runs`` keeps each repeat's own figures, with the prompt tokens its engine said it
    served from a cache (``cached_tokens``; None where a run did not say).
    Called in the parent only: the workers send their raw runs.
    """
    from engine.metrics import Percentiles

    itl = Percentiles.of(x for r in runs for x in r["itl_s"])
    return {
        "prompt_tokens": runs[0]["prompt_tokens"],
        "generated_tokens": runs[0]["generated_tokens"],
        "repeats": len(runs),
        "ttft_s": statistics.median(r["ttft_s"] for r in runs),
        "decode_s": statistics.median(r["decode_s"] for r in runs),
        "prefill_tps": statistics.median(r["prefill_tps"] for r in runs),
        "decode_tps": statistics.median(r["decode_tps"] for r in runs),
        "itl_p50_ms": 1000 * itl.p50,
        "itl_p95_ms": 1000 * itl.p95,
        "prefill_tps_runs": [r["prefill_tps"] for r in runs],
        "decode_tps_runs": [r["decode_tps"] for r in runs],
        "runs": [{k: r.get(k) for k in RUN_FIELDS} for r in runs],
        "tokens": runs[0]["tokens"],
    }
