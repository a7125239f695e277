"""`kvchat eval weights --peer llama.cpp`: kvchat's perplexity next to llama.cpp's own
`llama-perplexity` on the same GGUF file, the same text and the same token ids.

llama-perplexity's method, replayed on kvchat's side: the text tokenized by llama.cpp
(`llama-tokenize`, so both score identical ids), cut into chunks of ``--ctx`` tokens, each
a fresh sequence whose first token becomes BOS when the vocabulary adds one, and only the
second half of each chunk scored (each scored token has at least ctx / 2 of context).
kvchat scores through its paged pool (`app.eval.perplexity.score_text`) with the weights as
it loads them (GGUF blocks converted to MLX affine, its CPU extension's matmuls).
"""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from engine.errors import KVChatError

DEFAULT_TEXT = Path("/usr/share/common-licenses/GPL-3")  # held out: not in the repository


def tool(name: str, bin_dir: str | None) -> str:
    """Path of llama.cpp's ``name`` binary: in ``bin_dir`` or on PATH."""
    path = str(Path(bin_dir) / name) if bin_dir else shutil.which(name)
    if not path or not os.access(path, os.X_OK):
        raise KVChatError(f"{name} not found (build llama.cpp's tools and pass "
                          "--llama-cpp-bin DIR, or put them on PATH)")
    return path


def llama_tokens(bin_dir: str | None, gguf: str, text: Path) -> list[int]:
    out = subprocess.run([tool("llama-tokenize", bin_dir), "-m", gguf, "-f", str(text),
                          "--ids", "--log-disable"], capture_output=True, text=True,
                         check=True).stdout
    return [int(t) for t in re.findall(r"-?\d+", out.strip().splitlines()[-1])]


def llama_perplexity(bin_dir: str | None, gguf: str, text: Path, ctx: int, chunks: int,
                     extra: list[str] = ()) -> float:
    """llama-perplexity's final estimate; ``extra``: more of its options (KV cache types)."""
    proc = subprocess.run([tool("llama-perplexity", bin_dir), "-m", gguf, "-f", str(text),
                           "-c", str(ctx), "-b", str(ctx), "--chunks", str(chunks),
                           "-t", str(os.cpu_count()), *extra], capture_output=True, text=True)
    ppl = final_perplexity(proc.stdout + proc.stderr, chunks)
    if proc.returncode or ppl is None:
        raise KVChatError(f"llama-perplexity failed: {(proc.stderr or proc.stdout)[-300:]}")
    return ppl


def final_perplexity(output: str, chunks: int) -> float | None:
    """The perplexity a llama-perplexity run printed: its "Final estimate", else its running
    estimate after the last chunk (``[chunks]PPL,``: the same figure, printed first). The
    final line is missing where llama.cpp finds the spread of the log-probabilities not
    positive (it logs an error instead) and was seen cut from captured output."""
    found = re.search(r"Final estimate: PPL = ([\d.]+)", output)
    if found:
        return float(found.group(1))
    last = re.findall(rf"\[{chunks}\]([\d.]+(?:e[+-]?\d+)?),", output)
    return float(last[-1]) if last else None


def kvchat_perplexity(engine, ids: list[int], ctx: int, chunks: int, bos: int | None
                      ) -> tuple[float, int]:
    """llama-perplexity's chunked score through kvchat's pool: (perplexity, tokens)."""
    from app.eval.perplexity import score_text

    first, nll = ctx // 2, []
    for c in range(chunks):
        piece = ids[c * ctx:(c + 1) * ctx]
        if bos is not None:
            piece = [bos, *piece[1:]]
        nll += score_text(engine, piece, chunk=ctx).nll[first:ctx - 1]
    return math.exp(sum(nll) / len(nll)), len(nll)


def _score(loaded, ids, ctx, chunks) -> tuple[float, int]:
    from engine import Engine, EngineConfig

    add_bos = bool(getattr(loaded.tokenizer._tokenizer, "add_bos_token", False))
    bos = loaded.config.get("bos_token_id") if add_bos else None
    engine = Engine(loaded, EngineConfig(kv_budget_bytes=64 << 20))
    try:
        return kvchat_perplexity(engine, ids, ctx, chunks, bos)
    finally:
        engine.shutdown()


def _score_int8(loaded, ids, ctx, chunks) -> float:
    """The same weights with `--activations int8` (llama.cpp's own activation rounding), on
    a fresh engine: no K/V of the int16 run is reused."""
    from engine.model.cpu_ext import ops

    before = ops.activation_bits()
    ops.set_activation_bits(8)
    try:
        return _score(loaded, ids, ctx, chunks)[0]
    finally:
        ops.set_activation_bits(before)


def evaluate(model: str, *, bin_dir: str | None, text: Path, ctx: int = 512,
             max_chunks: int = 16, float32: bool = True) -> dict:
    """Both perplexities of GGUF ``model`` on ``text``; what ``--json`` writes."""
    from engine import load_model

    if not model or not model.endswith(".gguf"):
        raise KVChatError("--peer llama.cpp needs --model FILE.gguf (llama.cpp reads GGUF)")
    if not text.is_file():
        raise KVChatError(f"text not found: {text} (give --text FILE)")
    started = time.perf_counter()
    ids = llama_tokens(bin_dir, model, text)
    chunks = min(max_chunks, len(ids) // ctx)
    if chunks < 1:
        raise KVChatError(f"{text} has {len(ids)} tokens: fewer than one {ctx}-token chunk")
    loaded = load_model(model)
    ours, scored = _score(loaded, ids, ctx, chunks)
    int8 = _score_int8(loaded, ids, ctx, chunks) if "int16-x" in loaded.matmul else None
    # the same converted weights dequantized, computed in float32: what the conversion
    # alone gives, apart from either engine's low-precision activations
    f32 = _score(load_model(model, weights="float32"), ids, ctx, chunks)[0] if float32 else None
    theirs = llama_perplexity(bin_dir, model, text, ctx, chunks)
    return {"model": model, "text": str(text), "ctx": ctx, "chunks": chunks,
            "kvchat_float32_ppl": f32, "scored_tokens": scored,
            "kvchat_weights": loaded.weight_format,
            "kvchat_matmul": loaded.matmul, "kvchat_ppl": ours, "llama_cpp_ppl": theirs,
            "kvchat_int8_ppl": int8,
            "int8_diff_pct": 100 * (int8 / theirs - 1) if int8 else None,
            "diff_pct": 100 * (ours / theirs - 1),
            "seconds": round(time.perf_counter() - started, 1)}


def report(r: dict) -> str:
    return (f"{Path(r['model']).name}: {r['chunks']} x {r['ctx']}-token chunks of "
            f"{Path(r['text']).name}, {r['scored_tokens']} scored tokens\n"
            f"  kvchat ({r['kvchat_weights']}, {r['kvchat_matmul']}) perplexity "
            f"{r['kvchat_ppl']:.4f}\n"
            + (f"  kvchat float32 (same weights)       perplexity "
               f"{r['kvchat_float32_ppl']:.4f}\n" if r.get("kvchat_float32_ppl") else "")
            + (f"  kvchat --activations int8           perplexity "
               f"{r['kvchat_int8_ppl']:.4f}\n" if r.get("kvchat_int8_ppl") else "")
            + f"  llama.cpp llama-perplexity          perplexity {r['llama_cpp_ppl']:.4f}\n"
            f"  kvchat vs llama.cpp: {r['diff_pct']:+.3f} %"
            + (f" (int8 activations: {r['int8_diff_pct']:+.3f} %)"
               if r.get("int8_diff_pct") is not None else ""))


def add_args(p) -> None:
    """``--peer`` and its options on ``kvchat eval weights``' parser."""
    from app.arg_types import int_in

    p.add_argument("--peer", choices=["mlx-lm", "llama.cpp"], default="mlx-lm",
                   help="llama.cpp: perplexity beside llama-perplexity on the same GGUF")
    p.add_argument("--llama-cpp-bin", default=None, metavar="DIR",
                   help="where llama-perplexity and llama-tokenize are (default: PATH)")
    p.add_argument("--text", type=Path, default=None,
                   help=f"text to score with --peer llama.cpp ({DEFAULT_TEXT})")
    p.add_argument("--ctx", type=int_in(16), default=512, help="chunk size (llama.cpp's -c)")
    p.add_argument("--chunks", type=int_in(1), default=16, help="at most this many chunks")


def run(args) -> int:
    import json

    result = evaluate(args.model, bin_dir=args.llama_cpp_bin, text=args.text or DEFAULT_TEXT,
                      ctx=args.ctx, max_chunks=args.chunks, float32=not args.no_float32)
    print(report(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(f"[eval weights] done in {result['seconds']:.0f}s", file=sys.stderr)
    return 0
