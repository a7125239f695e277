"""Command line: `kvchat generate | bench | estimate | convert`.

Errors meant for the user (missing or corrupt model, empty or too long prompt)
print one line to stderr and exit with status 2 — never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

# transformers' advisory warnings (e.g. "sequence longer than the model max") would
# precede our own one-line errors; kvchat checks lengths itself.
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import engine  # noqa: F401  (preloads OpenBLAS before anything imports mlx.core)
from engine.errors import KVChatError

SAMPLE_PROMPT = "What is the capital of France? Answer in one sentence."


def parse_size(text: str) -> int:
    """'512M', '2G', '1048576' -> bytes."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="'default', a model dir, a .gguf or a hub repo id")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (16)")
    p.add_argument("--kv-budget", type=parse_size, default=parse_size("1G"),
                   help="bytes for the KV pool, e.g. 512M, 2G (1G)")
    p.add_argument("--weights", choices=["auto", "float32", "shipped"], default="auto",
                   help="weight format: auto picks float32 on CPU, shipped on GPU")
    p.add_argument("--cache-dir", default=None,
                   help="disk prefix cache directory (default ~/.cache/kvchat/prefix)")
    p.add_argument("--no-disk-cache", action="store_true",
                   help="keep prefix blocks in RAM only (nothing written to disk)")


def build_engine(args):
    from engine import Engine, EngineConfig, load_model

    loaded = load_model(args.model, weights=args.weights)
    config = EngineConfig(block_size=args.block_size, kv_budget_bytes=args.kv_budget,
                          disk_cache=not getattr(args, "no_disk_cache", False),
                          disk_cache_dir=getattr(args, "cache_dir", None))
    return Engine(loaded, config)


def cmd_generate(args) -> int:
    from engine import SamplingParams
    from engine.generation import collect

    if args.prompt_file is not None:
        try:
            prompt = Path(args.prompt_file).read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise KVChatError(f"cannot read prompt file {args.prompt_file}: {e}") from e
    else:
        prompt = args.prompt if args.prompt is not None else SAMPLE_PROMPT
    if not prompt.strip():
        raise KVChatError("the prompt is empty")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temp, seed=args.seed,
                            top_p=args.top_p, stop=args.stop or [])
    eng = build_engine(args)
    ids = eng.encode_prompt(prompt, system=args.system, raw=args.raw)
    _, notice = eng.check_request(ids, params)
    if notice:
        print(f"kvchat: note: {notice}", file=sys.stderr)
    try:
        result = collect(_stream(eng, ids, params, args))
    finally:
        eng.shutdown()  # releases the pool and drains the disk writer
    if result.finish_reason == "error":
        raise KVChatError(f"generation failed: {result.error}")
    stats = result.stats
    if args.json:
        out = {
            "text": result.text,
            "tokens": result.tokens,
            "prompt_tokens": stats.prompt_tokens,
            "generation_tokens": stats.generation_tokens,
            "finish_reason": result.finish_reason,
            "ttft_s": stats.ttft_s,
            "prefill_tps": stats.prefill_tps,
            "decode_tps": stats.decode_tps,
            "cached_tokens": stats.cached_tokens,
            "cache_source": stats.cache_source,
            "kv": stats.kv_dict(),
            "model": {
                "name": eng.loaded.name,
                "path": str(eng.loaded.path),
                "weight_format": eng.loaded.weight_format,
                "fingerprint": eng.loaded.fingerprint,
                "tokenizer_fingerprint": eng.loaded.tokenizer_fingerprint,
            },
        }
        print(json.dumps(out))
    else:
        print(
            f"[{stats.prompt_tokens} prompt tokens, {stats.prefill_tps:.1f} tok/s prefill | "
            f"{stats.generation_tokens} tokens, {stats.decode_tps:.1f} tok/s decode | "
            f"TTFT {stats.ttft_s:.2f}s | cached {stats.cached_tokens} ({stats.cache_source}) | "
            f"KV {stats.blocks_used} blocks, "
            f"{stats.bytes_used / 2**20:.1f} MiB | {result.finish_reason}]",
            file=sys.stderr,
        )
    return 0


def _stream(eng, ids, params, args):
    """The request's events, echoing text as it streams unless --json."""
    for event in eng.generate(ids, params, tenant=args.tenant,
                              permission_version=args.permission_version):
        if not args.json:
            sys.stdout.write(event.text)
            sys.stdout.flush()
        yield event
    if not args.json:
        sys.stdout.write("\n")


def cmd_chat(args) -> int:
    from functools import partial

    from app.tui import run
    from app.tui.app import default_engine_factory

    factory = partial(default_engine_factory, weights=args.weights,
                      block_size=args.block_size, kv_budget_bytes=args.kv_budget,
                      disk_cache=not getattr(args, "no_disk_cache", False),
                      disk_cache_dir=getattr(args, "cache_dir", None))
    return run(model=args.model, engine_factory=factory, max_tokens=args.max_tokens,
               temperature=args.temp)


def cmd_estimate(args) -> int:
    from engine.model import memory
    from engine.model.loader import resolve_model_path

    config = json.loads((resolve_model_path(args.model) / "config.json").read_text())
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    est = memory.estimate(config["num_hidden_layers"], config.get("num_key_value_heads", heads),
                          head_dim, tokens=args.tokens, batch=args.batch, kv_bits=args.kv_bits,
                          block_size=args.block_size)
    limit = memory.engine_memory_limit()
    out = {
        "formula": "layers x 2 x kv_heads x head_dim x tokens x batch x bytes_per_element",
        "layers": est.num_layers, "kv_heads": est.num_kv_heads, "head_dim": est.head_dim,
        "tokens": est.tokens, "batch": est.batch, "kv_bits": est.kv_bits,
        "bytes_per_element": est.bytes_per_element,
        "bytes_per_token": est.bytes_per_token, "total_bytes": est.total_bytes,
        "block_size": est.block_size, "blocks": est.blocks, "block_bytes": est.block_bytes,
        "backend": memory.backend(), "engine_memory_limit_bytes": limit,
        "fits": est.block_bytes <= limit, "share_of_limit": est.block_bytes / limit,
        "kv_budget_bytes": args.kv_budget,
        "kv_budget_blocks": int(args.kv_budget // (est.block_size * est.bytes_per_token)),
        "fits_kv_budget": est.block_bytes <= args.kv_budget,
        "context_length": config.get("max_position_embeddings"),
    }
    if args.json:
        print(json.dumps(out))
        return 0
    mib = 2**20
    print(f"KV cache for {est.tokens} tokens x batch {est.batch} at {est.kv_bits}-bit:")
    print(f"  {est.num_layers} layers x 2 x {est.num_kv_heads} kv heads x {est.head_dim} head dim "
          f"x {est.bytes_per_element:g} B = {est.bytes_per_token:,.0f} B per token")
    print(f"  total {est.total_bytes:,} B ({est.total_bytes / mib:.1f} MiB)")
    print(f"  {est.blocks} blocks of {est.block_size} tokens = {est.block_bytes / mib:.1f} MiB "
          f"(last block of each sequence rounds up)")
    verdict = "fits" if out["fits"] else "does NOT fit"
    print(f"  {verdict} in the {limit / mib:,.0f} MiB the engine may use here "
          f"({memory.backend()}; {100 * out['share_of_limit']:.1f}% of it)")
    pool = "fits" if out["fits_kv_budget"] else "does NOT fit"
    print(f"  {pool} in a KV pool of {args.kv_budget / mib:,.0f} MiB (--kv-budget): "
          f"{out['kv_budget_blocks']} blocks of this format, {est.blocks} needed")
    ctx = out["context_length"]
    if ctx and est.tokens > ctx:
        print(f"  note: {est.tokens} tokens exceed the model's context of {ctx}")
    return 0


def cmd_convert(args) -> int:
    from engine.model.loader import resolve_model_path

    print(resolve_model_path(args.model))
    return 0


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvchat", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")

    g = sub.add_parser("generate", help="generate a reply to one prompt")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", help="read the prompt from a file")
    g.add_argument("--system", default=None, help="system prompt")
    g.add_argument("--raw", action="store_true", help="skip the chat template")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temp", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.add_argument("--tenant", default="local", help="prefix-cache scope (default: local)")
    g.add_argument("--permission-version", type=int, default=0,
                   help="bump to make this tenant's older cached blocks unreachable")
    add_engine_args(g)
    g.set_defaults(func=cmd_generate)

    ch = sub.add_parser("chat", help="the terminal chat (the default command)")
    ch.add_argument("--max-tokens", type=int, default=512, help="max tokens per answer (512)")
    ch.add_argument("--temp", type=float, default=0.0, help="0 = greedy")
    add_engine_args(ch)
    ch.set_defaults(func=cmd_chat)

    e = sub.add_parser("estimate", help="KV-cache memory for a context size")
    e.add_argument("--model", default=None)
    e.add_argument("--tokens", type=int, required=True)
    e.add_argument("--batch", type=int, default=1)
    e.add_argument("--kv-bits", type=int, choices=[16, 8, 4], default=16)
    e.add_argument("--block-size", type=int, default=16)
    e.add_argument("--kv-budget", type=parse_size, default=parse_size("1G"),
                   help="KV pool size to compare with (1G, the engine's default)")
    e.add_argument("--json", action="store_true")
    e.set_defaults(func=cmd_estimate)

    c = sub.add_parser("convert", help="convert a GGUF (default: the embedded model) to MLX")
    c.add_argument("--model", default=None)
    c.set_defaults(func=cmd_convert)

    from app import bench, cache_cli

    bench.add_parser(sub)
    cache_cli.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        args = parser.parse_args(["chat", *(argv or [])])
    try:
        return args.func(args)
    except (KVChatError, ValueError, OSError) as e:
        print(f"kvchat: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kvchat: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
