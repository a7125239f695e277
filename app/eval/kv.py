"""`kvchat eval kv`: KV cache formats judged by quality, not only by bytes and speed.

Each format (a name in `FORMATS`, mapped to `EngineConfig` fields) runs the same
inputs on the default model: perplexity of long documents through the paged pool,
greedy agreement with the reference format (the first listed), needle-in-a-haystack
recall at 1k-7k tokens, valid-JSON answers, KV bytes per token and sequences per
GiB, and decode speed. Writes ``kv_eval.md`` and ``kv_eval.png`` (and ``--json``).

A new KV format is one more `FORMATS` entry (and a `BITS` entry for ``--bits``).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from app.eval.measure import FULL, QUICK, Plan

if TYPE_CHECKING:
    from engine import LoadedModel

RESIDUAL = {"kv_residual": True}
FORMATS: dict[str, dict] = {
    "f32": {"kv_dtype": "float32"},
    "f16": {"kv_dtype": "float16"},
    "bf16": {"kv_dtype": "bfloat16"},
    "q8": {"kv_bits": 8},
    "q4": {"kv_bits": 4},
    "k8v4": {"k_bits": 8, "v_bits": 4},
    "k4v8": {"k_bits": 4, "v_bits": 8},
    "q8g32": {"kv_bits": 8, "kv_group_size": 32},
    "q4g32": {"kv_bits": 4, "kv_group_size": 32},
    "k8v4g32": {"k_bits": 8, "v_bits": 4, "kv_group_size": 32},
    # the same without the rotation (`kvcache.rotation`): what it buys, measured
    "q8-plain": {"kv_bits": 8, "kv_rotation": False},
    "q4-plain": {"kv_bits": 4, "kv_rotation": False},
    "k8v4-plain": {"k_bits": 8, "v_bits": 4, "kv_rotation": False},
    # full blocks quantized once, the newest in float16 (`kvcache.residual`): keys per
    # channel within a block (-kivi) or per token (-res)
    "q8-kivi": {"kv_bits": 8, **RESIDUAL, "kv_key_channel": True},
    "k8v4-kivi": {"k_bits": 8, "v_bits": 4, **RESIDUAL, "kv_key_channel": True},
    "k4v8-kivi": {"k_bits": 4, "v_bits": 8, **RESIDUAL, "kv_key_channel": True},
    "q4-kivi": {"kv_bits": 4, **RESIDUAL, "kv_key_channel": True},
    "q4-kivi-plain": {"kv_bits": 4, **RESIDUAL, "kv_key_channel": True, "kv_rotation": False},
    "k8v4-res": {"k_bits": 8, "v_bits": 4, **RESIDUAL},
    "q4-res": {"kv_bits": 4, **RESIDUAL},
}
"""Format name -> `EngineConfig` keyword arguments (quantized ones rotated unless -plain)."""

BITS: dict[int, str] = {32: "f32", 16: "f16", 8: "q8", 4: "q4"}
"""``--bits`` value -> format name."""

NOTES = [
    "perplexity: generated documents (raw text, no chat template) scored teacher-forced "
    "through the paged pool in 512-token chunks; top-1 agreement compares the model's "
    "next-token guesses at every position with the reference run's",
    "greedy decoding everywhere; greedy agreement decodes a fixed length (EOS ignored) and "
    "counts matching tokens up to the first divergence",
    "needle: several facts per generated haystack, one question each through the chat "
    "template; recalled = the value appears in the answer (24 tokens at most); the probes "
    "of one haystack share its K/V through the prefix cache (same format), so only the "
    "question is prefilled per probe",
    "speed: cold prompts, prefix cache off; decode tok/s excludes prefill",
]


def log(message: str) -> None:
    print(f"[eval kv] {message}", file=sys.stderr, flush=True)


# -- arguments ---------------------------------------------------------------------------

def _supported() -> str:
    return (f"this build supports --bits {', '.join(map(str, BITS))} and --formats "
            f"{', '.join(FORMATS)}")


def format_list(text: str) -> list[str]:
    """``--formats f32,f16``: known names, in order (a repeated name is run again)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError("name at least one format")
    unknown = [n for n in names if n not in FORMATS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown format {', '.join(unknown)}; {_supported()}")
    return names


def bits_list(text: str) -> list[str]:
    """``--bits 16,8``: KV bits -> format names; bits this build lacks are an error."""
    names = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        try:
            bits = int(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--bits takes integers, not {part!r}") from None
        if bits not in BITS:
            raise argparse.ArgumentTypeError(f"{bits}-bit KV is not available; {_supported()}")
        names.append(BITS[bits])
    if not names:
        raise argparse.ArgumentTypeError("name at least one bit width")
    return names


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``kv`` on the subparsers of ``kvchat eval``."""
    p = subparsers.add_parser("kv", help="KV cache formats judged by quality",
                              description=__doc__.splitlines()[0])
    which = p.add_mutually_exclusive_group()
    which.add_argument("--formats", type=format_list, default=None, metavar="NAMES",
                       help=f"comma-separated KV formats, the first is the reference "
                            f"({', '.join(FORMATS)}; default f32,f16)")
    which.add_argument("--bits", type=bits_list, default=None, dest="bits_formats", metavar="BITS",
                       help="the same by KV bits: "
                            + ", ".join(f"{b} = {n}" for b, n in BITS.items()))
    p.add_argument("--json", default=None, metavar="FILE", help="write every figure as JSON")
    p.add_argument("--out", default="kv-eval", metavar="DIR",
                   help="directory for kv_eval.md and kv_eval.png (kv-eval)")
    p.add_argument("--quick", action="store_true", help="a small run (tests, smoke checks)")
    p.add_argument("--model", default=None, help="model to evaluate (default: the embedded one)")
    p.add_argument("--text", action="append", default=[], metavar="FILE",
                   help="held-out natural text to score for perplexity, KL and top-1 "
                        "(repeatable; each cut to the plan's document length) instead of "
                        "generated documents")
    from app.eval import kv_peer

    kv_peer.add_args(p)
    p.set_defaults(func=run)
    return p


# -- figures -----------------------------------------------------------------------------

def labels(names: list[str]) -> list[str]:
    """Column labels: a format listed again is "f32#2"."""
    seen: dict[str, int] = {}
    out = []
    for n in names:
        seen[n] = seen.get(n, 0) + 1
        out.append(n if seen[n] == 1 else f"{n}#{seen[n]}")
    return out


def machine() -> dict:
    import mlx.core as mx

    return {"platform": platform.platform(), "machine": platform.machine(),
            "python": platform.python_version(), "mlx": mx.__version__,
            "metal": mx.metal.is_available()}


def evaluate(names: list[str], *, plan: Plan, model: str | None = None,
             loaded: LoadedModel | None = None, texts: list[str] = ()) -> dict:
    """Run every format and return the report (what ``--json`` writes).

    Args:
        names: format names (`FORMATS` keys); the first is the reference.
        plan: `FULL` or `QUICK` (or any `Plan`).
        model: what to load when ``loaded`` is not given (None = the default model).
        loaded: an already loaded model (tests share one).
        texts: held-out natural text to score instead of generated documents.
    """
    from app.eval.measure import build_inputs, measure_format, with_engine
    from app.eval.summary import summarize

    started, cpu_started = time.perf_counter(), time.process_time()
    if loaded is None:
        from engine import load_model

        log("loading the model")
        loaded = load_model(model)
    box: list = []

    def prepare(engine) -> None:
        fitted = plan.fit(engine.max_context)
        if fitted != plan:
            log(f"the model's context is {engine.max_context} tokens: longer texts are left out")
        box.extend([fitted, build_inputs(engine, fitted, texts)])

    with_engine(loaded, {}, prepare, prefix_cache=False)
    quick = plan is QUICK
    plan, inputs = box
    raws = []
    for label, name in zip(labels(names), names, strict=True):
        log(f"{label}: {FORMATS[name]}")
        t = time.perf_counter()
        raws.append(measure_format(loaded, FORMATS[name], inputs, plan,
                                   lambda m, label=label: log(f"{label}: {m}"),
                                   reference=raws[0] if raws else None))
        log(f"{label}: done in {time.perf_counter() - t:.0f}s")
    formats = [{"label": label, "format": name, "engine_config": FORMATS[name],
                **summarize(raw, raws[0], inputs)}
               for label, name, raw in zip(labels(names), names, raws, strict=True)]
    return {
        "model": loaded.name or "default", "weight_format": loaded.weight_format,
        "reference": labels(names)[0], "quick": quick,
        "plan": {"ppl_docs": len(inputs.ppl_docs), "ppl_tokens": plan.ppl_tokens,
                 "ppl_source": "user texts" if texts else "generated documents",
                 "agreement_prompts": len(inputs.agreement),
                 "agreement_tokens": plan.agreement_tokens,
                 "needle": [list(row) for row in plan.needle],
                 "needle_probes": len(inputs.needle), "json_prompts": len(inputs.json),
                 "json_tokens": plan.json_tokens, "speed_contexts": list(plan.speed_contexts),
                 "speed_tokens": plan.speed_tokens},
        "notes": NOTES,
        "machine": machine(),
        "seconds": round(time.perf_counter() - started, 1),
        "cpu_seconds": round(time.process_time() - cpu_started, 1),  # all threads
        "formats": formats,
    }


def write_outputs(result: dict, out: Path, json_path: Path | None = None) -> str:
    """Write kv_eval.md, kv_eval.png (and the JSON); return the Markdown."""
    from app.eval import report

    out.mkdir(parents=True, exist_ok=True)
    table = report.markdown(result)
    (out / "kv_eval.md").write_text(table + "\n")
    report.plot(result, out / "kv_eval.png")
    if json_path is not None:
        json_path.write_text(json.dumps(result, indent=2) + "\n")
    return table


def run(args) -> int:
    """Evaluate, write the table, the plot and (``--json``) the figures; print the table."""
    if getattr(args, "peer", None) == "llama.cpp":
        from app.eval import kv_peer

        return kv_peer.run(args, args.formats or args.bits_formats, FORMATS)
    names = args.formats or args.bits_formats or ["f32", "f16"]
    texts = []
    for path in args.text:
        try:
            texts.append(Path(path).read_text(encoding="utf-8", errors="replace"))
        except OSError as e:
            print(f"kvchat eval kv: cannot read --text {path}: {e.strerror}", file=sys.stderr)
            return 2
    result = evaluate(names, plan=QUICK if args.quick else FULL, model=args.model, texts=texts)
    out, json_path = Path(args.out), Path(args.json) if args.json else None
    print(write_outputs(result, out, json_path))
    log(f"wrote {out / 'kv_eval.md'} and {out / 'kv_eval.png'}"
        + (f" and {json_path}" if json_path else "")
        + f" ({result['seconds']:.0f}s, {result['cpu_seconds']:.0f}s of CPU)")
    return 0
