"""`kvchat estimate`: KV-cache memory for a context size, from the model's config alone."""

from __future__ import annotations

import json

from app import arg_types
from app.engine_args import DEFAULT_KV_BUDGET, parse_size
from engine.errors import KVChatError


def add_parser(sub) -> None:
    """Register ``estimate`` on the CLI's subparsers object."""
    e = sub.add_parser("estimate", help="KV-cache memory for a context size")
    e.add_argument("--model", default=None)
    # Upper bounds keep the arithmetic in floats' range; both are far beyond any machine.
    e.add_argument("--tokens", type=arg_types.int_in(1, 1 << 40), required=True,
                   help="tokens per sequence (>= 1)")
    e.add_argument("--batch", type=arg_types.int_in(1, 1 << 20), default=1,
                   help="sequences (1)")
    e.add_argument("--kv-bits", type=int, choices=[16, 8, 4], default=16)
    e.add_argument("--block-size", type=arg_types.block_size, default=16,
                   help="tokens per KV block, 1..1024 (16)")
    e.add_argument("--kv-budget", type=arg_types.size, default=parse_size(DEFAULT_KV_BUDGET),
                   help=f"KV pool size to compare with ({DEFAULT_KV_BUDGET}, the engine's default)")
    e.add_argument("--json", action="store_true")
    e.set_defaults(func=run)


def model_shape(spec: str | None) -> dict:
    """The model's config.json (checked for the fields the estimate needs)."""
    from engine.model.loader import resolve_model_path

    path = resolve_model_path(spec) / "config.json"
    try:
        config = json.loads(path.read_text())
        heads = int(config["num_attention_heads"])
        layers = int(config["num_hidden_layers"])
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
        kv_heads = int(config.get("num_key_value_heads", heads))
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
        raise KVChatError(f"{path} does not describe a transformer's attention: {e!r}") from e
    return dict(layers=layers, kv_heads=kv_heads, head_dim=head_dim,
                context_length=config.get("max_position_embeddings"))


def run(args) -> int:
    """Print (or emit as JSON) the estimate and whether it fits here."""
    from engine.model import backend, memory

    shape = model_shape(args.model)
    est = memory.estimate(shape["layers"], shape["kv_heads"], shape["head_dim"],
                          tokens=args.tokens, batch=args.batch, kv_bits=args.kv_bits,
                          block_size=args.block_size)
    limit = memory.engine_memory_limit()
    out = {
        "formula": "layers x 2 x kv_heads x head_dim x tokens x batch x bytes_per_element",
        "layers": est.num_layers, "kv_heads": est.num_kv_heads, "head_dim": est.head_dim,
        "tokens": est.tokens, "batch": est.batch, "kv_bits": est.kv_bits,
        "bytes_per_element": est.bytes_per_element,
        "bytes_per_token": est.bytes_per_token, "total_bytes": est.total_bytes,
        "block_size": est.block_size, "blocks": est.blocks, "block_bytes": est.block_bytes,
        "backend": backend.backend(), "engine_memory_limit_bytes": limit,
        "fits": est.block_bytes <= limit, "share_of_limit": est.block_bytes / limit,
        "kv_budget_bytes": args.kv_budget,
        "kv_budget_blocks": int(args.kv_budget // (est.block_size * est.bytes_per_token)),
        "fits_kv_budget": est.block_bytes <= args.kv_budget,
        "context_length": shape["context_length"],
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
          f"({backend.backend()}; {100 * out['share_of_limit']:.1f}% of it)")
    pool = "fits" if out["fits_kv_budget"] else "does NOT fit"
    print(f"  {pool} in a KV pool of {args.kv_budget / mib:,.0f} MiB (--kv-budget): "
          f"{out['kv_budget_blocks']} blocks of this format, {est.blocks} needed")
    ctx = out["context_length"]
    if ctx and est.tokens > ctx:
        print(f"  note: {est.tokens} tokens exceed the model's context of {ctx}")
    return 0
