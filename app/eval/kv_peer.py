"""`kvchat eval kv --peer llama.cpp`: each KV format's perplexity cost beside llama.cpp's
own KV cache types, on the same GGUF, the same text and the same token ids.

Both engines score by llama-perplexity's method (`app.eval.llama_peer`: chunks of ``--ctx``
tokens, the second half of each scored). kvchat runs once per format through its paged
pool; llama.cpp runs `llama-perplexity` once per ``-ctk/-ctv`` pair with flash attention
on (its quantized V cache needs it). The figure that compares is each engine's delta
against its own f16 run: the two engines' f16 perplexities differ by their weights'
arithmetic, which the KV format does not touch.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from app.eval import llama_peer
from engine.errors import KVChatError

# kvchat format -> llama.cpp's (-ctk, -ctv) of the same bits. llama.cpp's q8_0 / q4_0 keep
# one scale per 32 elements (no bias); kvchat's keep a scale and a bias per group of 64.
LLAMA_TYPES: dict[str, tuple[str, str]] = {
    "f32": ("f32", "f32"), "f16": ("f16", "f16"), "bf16": ("bf16", "bf16"),
    "q8": ("q8_0", "q8_0"), "q8g32": ("q8_0", "q8_0"), "q8-plain": ("q8_0", "q8_0"),
    "q4": ("q4_0", "q4_0"), "q4g32": ("q4_0", "q4_0"), "q4-plain": ("q4_0", "q4_0"),
    "k8v4": ("q8_0", "q4_0"), "k8v4g32": ("q8_0", "q4_0"), "k8v4-plain": ("q8_0", "q4_0"),
    "k4v8": ("q4_0", "q8_0"),
    # the residual formats (per-channel keys, the newest block exact) against the same bits
    "q8-kivi": ("q8_0", "q8_0"), "k8v4-kivi": ("q8_0", "q4_0"), "q4-kivi": ("q4_0", "q4_0"),
    "k4v8-kivi": ("q4_0", "q8_0"), "q4-kivi-plain": ("q4_0", "q4_0"),
}
DEFAULT_FORMATS = ["f16", "q8", "k8v4", "q4"]


def kvchat_ppl(loaded, kv_config: dict, ids: list[int], ctx: int, chunks: int,
               bos: int | None) -> float:
    """llama-perplexity's chunked perplexity through a pool of one KV format."""
    from engine import Engine, EngineConfig

    engine = Engine(loaded, EngineConfig(kv_budget_bytes=64 << 20, **kv_config))
    try:
        return llama_peer.kvchat_perplexity(engine, ids, ctx, chunks, bos)[0]
    finally:
        engine.shutdown()


def log(message: str) -> None:
    print(f"[eval kv] {message}", file=sys.stderr, flush=True)


def evaluate(model: str, names: list[str], formats: dict[str, dict], *, bin_dir: str | None,
             text: Path, ctx: int = 512, max_chunks: int = 16) -> dict:
    """Every format's perplexity in both engines; what ``--json`` writes. ``formats``:
    format name -> `EngineConfig` keyword arguments (`app.eval.kv.FORMATS`)."""
    from engine import load_model
    from engine.model.loader import DEFAULT_MODEL, default_gguf_path

    gguf = str(default_gguf_path()) if model in (None, "", DEFAULT_MODEL) else model
    if not gguf.endswith(".gguf"):
        raise KVChatError("--peer llama.cpp needs a GGUF model (llama.cpp reads GGUF)")
    missing = [n for n in names if n not in LLAMA_TYPES]
    if missing:
        raise KVChatError(f"llama.cpp has no KV cache type for {', '.join(missing)}")
    if not text.is_file():
        raise KVChatError(f"text not found: {text}")
    started = time.perf_counter()
    ids = llama_peer.llama_tokens(bin_dir, gguf, text)
    chunks = min(max_chunks, len(ids) // ctx)
    if chunks < 1:
        raise KVChatError(f"{text} has {len(ids)} tokens: fewer than one {ctx}-token chunk")
    loaded = load_model(model)  # the default by its name: a loaded one may be shared
    add_bos = bool(getattr(loaded.tokenizer._tokenizer, "add_bos_token", False))
    bos = loaded.config.get("bos_token_id") if add_bos else None
    rows = []
    for name in names:
        ctk, ctv = LLAMA_TYPES[name]
        log(f"{name}: kvchat")
        ours = kvchat_ppl(loaded, formats[name], ids, ctx, chunks, bos)
        log(f"{name}: llama-perplexity -ctk {ctk} -ctv {ctv}")
        theirs = llama_peer.llama_perplexity(bin_dir, gguf, text, ctx, chunks,
                                             ["-fa", "on", "-ctk", ctk, "-ctv", ctv])
        rows.append({"format": name, "kvchat_ppl": ours, "llama_cpp_types": [ctk, ctv],
                     "llama_cpp_ppl": theirs})
    for row in rows:
        row["kvchat_delta_pct"] = 100 * (row["kvchat_ppl"] / rows[0]["kvchat_ppl"] - 1)
        row["llama_cpp_delta_pct"] = 100 * (row["llama_cpp_ppl"] / rows[0]["llama_cpp_ppl"] - 1)
    return {"model": gguf, "text": str(text), "ctx": ctx, "chunks": chunks,
            "scored_tokens": chunks * (ctx - 1 - ctx // 2), "reference": names[0],
            "formats": rows, "seconds": round(time.perf_counter() - started, 1)}


def report(r: dict) -> str:
    """The side-by-side table, deltas against each engine's own reference run."""
    ref = r["reference"]
    lines = [f"{Path(r['model']).name}: {r['chunks']} x {r['ctx']}-token chunks of "
             f"{Path(r['text']).name}, {r['scored_tokens']} scored tokens",
             "",
             f"| format | kvchat ppl | vs {ref} | llama.cpp -ctk/-ctv | llama.cpp ppl | vs {ref} |",
             "|---|---:|---:|---|---:|---:|"]
    for row in r["formats"]:
        lines.append(f"| {row['format']} | {row['kvchat_ppl']:.4f} | "
                     f"{row['kvchat_delta_pct']:+.2f} % | {'/'.join(row['llama_cpp_types'])} | "
                     f"{row['llama_cpp_ppl']:.4f} | {row['llama_cpp_delta_pct']:+.2f} % |")
    return "\n".join(lines)


def add_args(p) -> None:
    """``--peer`` and its options on ``kvchat eval kv``'s parser."""
    from app.arg_types import int_in

    p.add_argument("--peer", choices=["llama.cpp"], default=None,
                   help="llama.cpp: each format's perplexity cost beside llama-perplexity's "
                        "-ctk/-ctv of the same bits (formats default to "
                        f"{','.join(DEFAULT_FORMATS)}; text: the first --text or "
                        f"{llama_peer.DEFAULT_TEXT})")
    p.add_argument("--llama-cpp-bin", default=None, metavar="DIR",
                   help="where llama-perplexity and llama-tokenize are (default: PATH)")
    p.add_argument("--ctx", type=int_in(16), default=512,
                   help="with --peer: chunk size (llama.cpp's -c)")
    p.add_argument("--chunks", type=int_in(1), default=16,
                   help="with --peer: at most this many chunks")


def run(args, names: list[str] | None, formats: dict[str, dict]) -> int:
    text = Path(args.text[0]) if args.text else llama_peer.DEFAULT_TEXT
    result = evaluate(args.model, names or DEFAULT_FORMATS, formats,
                      bin_dir=args.llama_cpp_bin, text=text, ctx=args.ctx,
                      max_chunks=args.chunks)
    print(report(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(f"[eval kv] done in {result['seconds']:.0f}s", file=sys.stderr)
    return 0
