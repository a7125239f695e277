"""`kvchat eval weights`: kvchat's quantized CPU path against mlx-lm on the same weights.

kvchat on the CPU runs the shipped Q4/Q8 weights through its C++ extension; mlx-lm as
shipped runs the same converted GGUF quantized with its own model code. On the same
token ids, both sides (and, unless ``--no-float32``, kvchat's ``--weights float32``):
- score texts teacher-forced in 512-token chunks through their own KV cache (kvchat:
  the paged pool, `app.eval.perplexity`; mlx-lm: its model forward with its prompt
  cache): perplexity, and the next-token top-1 guess at every position;
- decode the texts that are bench prompts greedily (EOS ignored): tokens identical
  before the first divergence, and equal positions, against mlx-lm's.

Texts: `kvchat bench`'s prompts (same ids, lengths and seed) and generated prose
(`app.eval.docs`). mlx-lm runs in a fresh interpreter without the OpenBLAS preload; its
greedy tokens continue from the cache its scoring filled. ``--peer llama.cpp``: perplexity
beside llama.cpp's own `llama-perplexity` on a GGUF (`app.eval.llama_peer`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

WORKER_FLAG = "--mlx-lm-worker"
CHUNK = 512  # tokens per teacher-forced forward, both sides (as `eval kv` scores)
DOC_SEED = 1  # the first of `eval kv`'s perplexity documents
FULL = {"lengths": [128, 1024], "gen_tokens": 64, "docs": 1, "doc_tokens": 1024}
QUICK = {"lengths": [48], "gen_tokens": 8, "docs": 0, "doc_tokens": 1024}
SIDES = ("kvchat", "mlx_lm", "float32")
LABELS = {"kvchat": "kvchat quantized", "mlx_lm": "mlx-lm as shipped",
          "float32": "kvchat float32"}


def log(message: str) -> None:
    print(f"[eval weights] {message}", file=sys.stderr, flush=True)


def _lengths(text: str) -> list[int]:
    from app.arg_types import lengths

    values = lengths(text)
    if min(values) < 2:
        raise argparse.ArgumentTypeError("a prompt needs at least 2 tokens to be scored")
    return values


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``weights`` on the subparsers of ``kvchat eval``."""
    from app.arg_types import int_in, non_negative_int

    p = subparsers.add_parser("weights", help="quantized weights: kvchat vs mlx-lm as shipped",
                              description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=_lengths, default=None,
                   help="bench prompt lengths, scored and decoded (128,1024)")
    p.add_argument("--gen-tokens", type=int_in(1), default=None,
                   help="greedy tokens per prompt, EOS ignored (64)")
    p.add_argument("--docs", type=non_negative_int, default=None,
                   help="generated 1024-token documents, scored only (1)")
    p.add_argument("--seed", type=non_negative_int, default=0,
                   help="the bench prompts' seed (0, as kvchat bench)")
    p.add_argument("--no-float32", action="store_true",
                   help="skip the kvchat --weights float32 column")
    p.add_argument("--quick", action="store_true", help="one 48-token prompt, 8 tokens (tests)")
    p.add_argument("--json", default=None, metavar="FILE", help="write every figure as JSON")
    p.add_argument("--model", default=None, help="model to evaluate (default: the embedded one)")
    from app.eval import llama_peer

    llama_peer.add_args(p)
    p.set_defaults(func=run)
    return p


def first_divergence(reference: list[int], other: list[int]) -> int:
    """Tokens identical before the first difference (the shorter length if none)."""
    pairs = enumerate(zip(reference, other, strict=False))
    return next((i for i, (a, b) in pairs if a != b), min(len(reference), len(other)))


def greedy_row(reference: list[int], other: list[int]) -> dict:
    return {"first_divergence": first_divergence(reference, other),
            "equal": sum(a == b for a, b in zip(reference, other, strict=False)),
            "total": len(reference)}


def perplexity(nll: list[float]) -> float:
    return math.exp(sum(nll) / len(nll))


def summarize(texts: list[dict], sides: dict[str, dict]) -> dict:
    """Perplexity per side (all texts pooled and per text), deltas and agreements."""
    ref = sides["mlx_lm"]
    others = [s for s in SIDES if s in sides and s != "mlx_lm"]
    pooled = {s: perplexity([x for sc in sides[s]["scores"] for x in sc["nll"]]) for s in sides}
    n = sum(len(sc["nll"]) for sc in ref["scores"])
    rows, greedy = [], []
    for i, text in enumerate(texts):
        row = {"name": text["name"], "tokens": len(ref["scores"][i]["nll"]),
               "perplexity": {s: perplexity(sides[s]["scores"][i]["nll"]) for s in sides}}
        for s in others:
            a, b = ref["scores"][i]["top1"], sides[s]["scores"][i]["top1"]
            row[f"top1_{s}_vs_mlx_lm"] = sum(x == y for x, y in zip(a, b, strict=True)) / len(a)
        rows.append(row)
        if text["gen_tokens"]:
            greedy.append({"prompt": text["name"], "prompt_tokens": len(text["ids"]),
                           **{f"{s}_vs_mlx_lm": greedy_row(ref["greedy"][i], sides[s]["greedy"][i])
                              for s in others},
                           "tokens": {s: sides[s]["greedy"][i] for s in sides}})
    top1 = {s: sum(r[f"top1_{s}_vs_mlx_lm"] * r["tokens"] for r in rows) / n for s in others}
    return {"perplexity": pooled, "tokens_scored": n,
            "delta_pct": {s: 100 * (pooled[s] / pooled["mlx_lm"] - 1) for s in others},
            "top1_agreement_vs_mlx_lm": top1, "texts": rows, "greedy": greedy}


def table(result: dict) -> str:
    """The Markdown table ``run`` prints."""
    sides = [s for s in SIDES if s in result["perplexity"]]
    delta, top1 = result["delta_pct"], result["top1_agreement_vs_mlx_lm"]

    def row(label: str, cell) -> str:
        return f"| {label} | " + " | ".join(cell(s) for s in sides) + " |"

    def greedy_cell(r: dict | None) -> str:
        return "" if r is None else f"{r['first_divergence']} / {r['equal']} of {r['total']}"
    lines = [row("", LABELS.get), "|---|" + "---:|" * len(sides),
             row(f"perplexity ({len(result['texts'])} texts, {result['tokens_scored']} tokens)",
                 lambda s: f"{result['perplexity'][s]:.4f}"),
             row("delta vs mlx-lm", lambda s: f"{delta[s]:+.3f} %" if s in delta else ""),
             row("next-token top-1 agreement vs mlx-lm",
                 lambda s: f"{100 * top1[s]:.2f} %" if s in top1 else "")]
    lines += [row(f"perplexity, {t['name']} ({t['tokens']} tokens)",
                  lambda s, t=t: f"{t['perplexity'][s]:.4f}") for t in result["texts"]]
    lines += [row(f"greedy, {g['prompt']} x {len(g['tokens']['mlx_lm'])} tokens: identical "
                  "before the first divergence / equal, vs mlx-lm",
                  lambda s, g=g: greedy_cell(g.get(f"{s}_vs_mlx_lm"))) for g in result["greedy"]]
    return "\n".join(lines)


def build_texts(tokenizer, *, lengths: list[int], gen_tokens: int, docs: int, doc_tokens: int,
                seed: int) -> list[dict]:
    """The bench's prompts (same ids as ``kvchat bench`` at these lengths and seed) + docs."""
    from app.bench.compare import WARMUP_PROMPT_TOKENS
    from app.bench.prompts import cold_prompts
    from app.eval import docs as gen_docs
    from engine import EngineConfig
    from engine.prompts import chat_ids

    _, prompts = cold_prompts(tokenizer, lengths, 1, block_size=EngineConfig().block_size,
                              warmup_tokens=WARMUP_PROMPT_TOKENS, seed=seed)
    texts = [{"name": f"bench prompt {n}", "ids": prompts[n][0], "gen_tokens": gen_tokens}
             for n in lengths]
    count = lambda text: len(tokenizer.encode(text))  # noqa: E731
    for i in range(docs):
        ids = chat_ids(tokenizer, gen_docs.document(DOC_SEED + i, doc_tokens, count),
                       raw=True)[:doc_tokens]
        texts.append({"name": f"generated document {i + 1}", "ids": ids, "gen_tokens": 0})
    return texts


def kvchat_side(loaded, texts: list[dict]) -> dict:
    """kvchat's scores (through the paged pool) and greedy tokens; a fresh engine, no cache."""
    from app.eval.measure import run_batch
    from app.eval.perplexity import score_text
    from engine import Engine, EngineConfig

    started = time.perf_counter()
    engine = Engine(loaded, EngineConfig(kv_budget_bytes=256 << 20, prefix_cache=False,
                                         disk_cache=False))
    scores, greedy = [], []
    try:
        for text in texts:
            s = score_text(engine, text["ids"], chunk=CHUNK)
            scores.append({"nll": s.nll, "top1": s.top1})
            greedy.append(run_batch(engine, [text["ids"]], text["gen_tokens"],
                                    ignore_eos=True)[0].tokens if text["gen_tokens"] else [])
    finally:
        engine.shutdown()
    return {"scores": scores, "greedy": greedy, "weight_format": loaded.weight_format,
            "cpu_ext": loaded.cpu_ext, "seconds": round(time.perf_counter() - started, 1)}


def worker_main(job_file: str) -> int:
    """The mlx-lm side, in its own interpreter: score and decode every text; print JSON."""
    out, sys.stdout = sys.stdout, sys.stderr  # a library's prints must not corrupt the JSON
    job = json.loads(Path(job_file).read_text())
    if "engine" in sys.modules:
        raise RuntimeError("the mlx-lm worker must not import kvchat's engine")
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    started = time.perf_counter()
    model, _ = load(job["model_path"])
    scores, greedy = [], []
    for text in job["texts"]:
        ids, gen = text["ids"], text["gen_tokens"]
        log(f"mlx-lm: {text['name']} ({len(ids)} tokens{f', {gen} greedy' if gen else ''})")
        cache, nll, top1, last = make_prompt_cache(model), [], [], None
        for start in range(0, len(ids), CHUNK):
            logits = model(mx.array([ids[start:start + CHUNK]]), cache=cache)[0]
            logits, last = logits.astype(mx.float32), mx.argmax(logits[-1])
            targets = ids[start + 1:start + CHUNK + 1]  # none past the text's last token
            if targets:
                scored = logits[:len(targets)]
                picked = mx.take_along_axis(scored, mx.array(targets)[:, None], axis=-1)[:, 0]
                n, t = mx.logsumexp(scored, axis=-1) - picked, mx.argmax(scored, axis=-1)
                nll += n.tolist()
                top1 += t.tolist()
        tokens = [int(last.item())] if gen else []
        if gen > 1:  # greedy (generate_step's default sampler) on from the scored prompt
            tokens += [int(tok) for tok, _ in generate_step(mx.array(tokens), model,
                                                            max_tokens=gen - 1,
                                                            prompt_cache=cache)]
        scores.append({"nll": nll, "top1": top1})
        greedy.append(tokens)
    import mlx_lm

    bits = sorted({m.bits for _, m in model.named_modules() if hasattr(m, "bits")})
    out.write(json.dumps({"scores": scores, "greedy": greedy,
                          "weight_format": "/".join(f"q{b}" for b in bits) or "float",
                          "mlx_lm_version": getattr(mlx_lm, "__version__", "?"),
                          "seconds": round(time.perf_counter() - started, 1)}) + "\n")
    out.flush()
    return 0


# -- the evaluation ----------------------------------------------------------------------

def evaluate(*, quick: bool = False, lengths: list[int] | None = None,
             gen_tokens: int | None = None, docs: int | None = None, seed: int = 0,
             float32: bool = True, model: str | None = None, loaded=None,
             loaded_float32=None) -> dict:
    """Run every side and return the report (what ``--json`` writes); tests pass models."""
    from app.bench.common import machine_info
    from app.bench.peers import run_worker
    from engine import load_model

    plan = dict(QUICK if quick else FULL)
    plan.update({k: v for k, v in (("lengths", lengths), ("gen_tokens", gen_tokens),
                                   ("docs", docs)) if v is not None})
    started = time.perf_counter()
    if loaded is None:
        log("loading the model (shipped weights, kvchat's CPU path)")
        loaded = load_model(model)
    notes = [] if loaded.cpu_ext else [
        f"kvchat's CPU extension is not in use (weights {loaded.weight_format}): the "
        "'quantized' column is not the quantized path"]
    texts = build_texts(loaded.tokenizer, lengths=plan["lengths"], gen_tokens=plan["gen_tokens"],
                        docs=plan["docs"], doc_tokens=plan["doc_tokens"], seed=seed)
    log(f"{len(texts)} texts, {sum(len(t['ids']) for t in texts)} tokens; kvchat quantized")
    sides = {"kvchat": kvchat_side(loaded, texts)}
    if float32:
        log("kvchat --weights float32")
        f32 = loaded_float32 or load_model(model, weights="float32")
        sides["float32"] = kvchat_side(f32, texts)
    log("mlx-lm as shipped, in a separate process (the slow part: its CPU quantized matmul)")
    job = {"model_path": str(loaded.path),
           "texts": [{k: t[k] for k in ("name", "ids", "gen_tokens")} for t in texts]}
    sides["mlx_lm"] = run_worker("app.eval.weights", WORKER_FLAG, job, "mlx-lm")
    return {
        "model": loaded.name, "path": str(loaded.path), "quick": quick,
        "weights": {s: sides[s]["weight_format"] for s in sides} | {
            "kvchat_cpu_ext": loaded.cpu_ext},
        "settings": {**plan, "seed": seed, "chunk": CHUNK, "greedy": True, "ignore_eos": True},
        **summarize(texts, sides),
        "side_seconds": {s: sides[s]["seconds"] for s in sides},
        "mlx_lm_version": sides["mlx_lm"]["mlx_lm_version"],
        "machine": machine_info(), "notes": notes,
        "seconds": round(time.perf_counter() - started, 1),
    }


def run(args) -> int:
    """Evaluate; print the table (stdout), write ``--json``."""
    if args.peer == "llama.cpp":
        from app.eval import llama_peer

        return llama_peer.run(args)
    result = evaluate(quick=args.quick, lengths=args.lengths, gen_tokens=args.gen_tokens,
                      docs=args.docs, seed=args.seed, float32=not args.no_float32,
                      model=args.model)
    print(table(result))
    for note in result["notes"]:
        print(f"note: {note}")
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
    log(f"done in {result['seconds']:.0f}s" + (f"; wrote {args.json}" if args.json else ""))
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == WORKER_FLAG:
        sys.exit(worker_main(sys.argv[2]))
    print(f"usage: python -m app.eval.weights {WORKER_FLAG} JOB.json (internal)", file=sys.stderr)
    sys.exit(2)
