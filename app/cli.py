"""Command line: `kvchat chat | generate | ask | estimate | serve | convert | bench | eval | cache
| dev`.

Errors meant for the user (missing or corrupt model, empty or too long prompt)
print one line to stderr and exit with status 2 — never a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

# transformers' advisory warnings (e.g. "sequence longer than the model max") would
# precede our own one-line errors; kvchat checks lengths itself.
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import engine  # noqa: F401  (preloads OpenBLAS before anything imports mlx.core)
from app import arg_types
from app.constraint_args import read_constraint
from app.context_policy import add_context_args
from app.disk_state import disk_cache_json
from app.distributed import add_distributed_args, print_rank_lines, run_if_worker
from app.echo import echo_events
from app.engine_args import add_engine_args, add_scope_args, build_engine, check_kv_budget
from app.engine_config import config_from_args
from app.engine_like import EngineLike
from engine.errors import KVChatError

SAMPLE_PROMPT = "What is the capital of France? Answer in one sentence."
# A prompt file may hold 4x what the context can: 4 bytes per token is typical of text,
# so 16 bytes per token leaves room for dense scripts while /dev/zero-sized input is refused.
PROMPT_BYTES_PER_TOKEN = 16


class UsageError(Exception):
    """A bad command line; `main` prints it as one line and exits with status 2."""


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (no usage block) and never exit."""

    def error(self, message: str):  # type: ignore[override]
        raise UsageError(message)


def read_prompt(args, max_context: int) -> str:
    """The prompt text: --prompt, the file's text (bounded by the context) or the sample."""
    if args.prompt_file is None:
        return args.prompt if args.prompt is not None else SAMPLE_PROMPT
    try:
        return arg_types.read_text_file(args.prompt_file, max_context * PROMPT_BYTES_PER_TOKEN)
    except ValueError as e:
        raise KVChatError(f"cannot read prompt file: {e}") from None


def cmd_generate(args) -> int:
    from engine import SamplingParams
    from engine.generation import collect

    if args.prompt is not None and not args.prompt.strip():
        raise KVChatError("the prompt is empty")  # before the model loads
    worker_status = run_if_worker(args)  # --distributed, ranks other than 0
    if worker_status is not None:
        return worker_status
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temp, seed=args.seed,
                            top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                            stop=args.stop or [], constraint=read_constraint(args))
    # one request: a pool of one full context is all it can use (the rest of the budget
    # would be allocated and zero-filled for nothing)
    eng = build_engine(args, pool_sequences=1, max_running=1)
    for notice in eng.notices:  # e.g. a KV format this model cannot use
        print(f"kvchat: note: {notice}", file=sys.stderr)
    if args.model not in (None, "default") and not args.json:  # one the user brought
        print(f"kvchat: model {eng.loaded.name}: {_architecture(eng)}", file=sys.stderr)
    try:
        prompt = read_prompt(args, eng.max_context)
        if not prompt.strip():
            raise KVChatError("the prompt is empty")
        ids = eng.encode_prompt(prompt, system=args.system, raw=args.raw)
        result = collect(_stream(eng, ids, params, args))
    finally:
        eng.shutdown()  # releases the pool and drains the disk writer
    if result.finish_reason == "error":
        raise KVChatError(f"generation failed: {result.error}")
    metrics = eng.metrics()  # after the drain: every write has succeeded or failed
    if metrics.disk_warning:  # the answer came; the disk cache did not work as asked
        print(f"kvchat: warning: disk prefix cache: {metrics.disk_warning}", file=sys.stderr)
    print_result(eng, result, as_json=args.json, metrics=metrics)
    print_rank_lines(eng)  # --distributed: each rank's pool accounting
    return 0


def print_result(eng: EngineLike, result, *, as_json: bool, metrics=None) -> None:
    """The answer's stats: one JSON object on stdout, or one summary line on stderr."""
    stats = result.stats
    metrics = metrics or eng.metrics()
    if as_json:
        loaded = eng.loaded
        print(json.dumps({
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
            "speculation": {"proposed": stats.spec_proposed, "accepted": stats.spec_accepted},
            "context_shift": {"shifts": stats.context_shifts,
                              "dropped_tokens": stats.shifted_tokens},
            "kv": stats.kv_dict(),
            "disk_cache": disk_cache_json(metrics),  # state: on / read-only / off, and why
            "model": {
                "name": loaded.name,
                "path": str(loaded.path),
                "weight_format": loaded.weight_format,
                "architecture": _architecture(eng),
                "cpu_ext": loaded.cpu_ext,
                "fingerprint": loaded.fingerprint,
                "tokenizer_fingerprint": loaded.tokenizer_fingerprint,
            },
        }))
        return
    print(
        f"[{stats.prompt_tokens} prompt tokens, {stats.prefill_tps:.1f} tok/s prefill | "
        f"{stats.generation_tokens} tokens, {stats.decode_tps:.1f} tok/s decode | "
        f"TTFT {stats.ttft_s:.2f}s | cached {stats.cached_tokens} ({stats.cache_source}) | "
        f"KV {stats.blocks_used} blocks, "
        f"{stats.bytes_used / 2**20:.1f} MiB | {result.finish_reason}"
        + (f" | context shifted {stats.context_shifts}x: {stats.shifted_tokens} tokens "
           "dropped" if stats.context_shifts else "")
        + (f" | {metrics.disk_write_errors} disk write errors"
           if metrics.disk_write_errors else "") + "]",
        file=sys.stderr,
    )


def _architecture(eng: EngineLike) -> str:
    """The runner's own account (layers, heads, windows, experts); the config's on ranks."""
    from engine.model.architectures import summary

    runner = getattr(eng, "runner", None)
    describe = getattr(runner, "describe", None)
    return describe() if callable(describe) else summary(eng.loaded.config)


def _stream(eng: EngineLike, ids, params, args):
    """The request's events, echoing text as it streams unless --json (a note first when
    its max tokens were reduced to fit)."""
    handle = eng.submit(ids, params, tenant=args.tenant,
                        permission_version=args.permission_version)
    if handle.notice:
        print(f"kvchat: note: {handle.notice}", file=sys.stderr)
    return echo_events(handle, show=not args.json)


def cmd_chat(args) -> int:
    from functools import partial

    from app.tui import run
    from app.tui.app import default_engine_factory

    config = config_from_args(args)
    check_kv_budget(config.kv_budget_bytes)  # one line here, not a notice inside the TUI
    factory = partial(default_engine_factory, weights=args.weights, config=config)
    return run(model=args.model, engine_factory=factory, max_tokens=args.max_tokens,
               temperature=args.temp, context_policy=args.context_policy,
               context_budget=args.context_budget)


def cmd_convert(args) -> int:
    from engine.model.loader import resolve_model_path

    print(resolve_model_path(args.model))
    return 0


def add_sampling_args(p: argparse.ArgumentParser, *, max_tokens: int,
                      typed_only: bool = False) -> None:
    """--max-tokens and --temp, shared by generate and chat.

    ``typed_only``: leave them None unless typed, so the chat's saved settings apply
    when the command line says nothing (the chat's defaults are the same values).
    """
    p.add_argument("--max-tokens", type=arg_types.positive_int,
                   default=None if typed_only else max_tokens,
                   help=f"max tokens per answer, >= 1 ({max_tokens})")
    p.add_argument("--temp", type=arg_types.temperature, default=None if typed_only else 0.0,
                   help="temperature, finite and >= 0 (0 = greedy)")


def make_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="kvchat", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")

    g = sub.add_parser("generate", help="generate a reply to one prompt")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--prompt", type=arg_types.utf8, help="prompt text")
    src.add_argument("--prompt-file", type=arg_types.regular_file,
                     help="read the prompt from a regular UTF-8 file (at most "
                          f"{PROMPT_BYTES_PER_TOKEN} bytes per token of context)")
    g.add_argument("--system", type=arg_types.utf8, default=None, help="system prompt")
    g.add_argument("--raw", action="store_true", help="skip the chat template")
    add_sampling_args(g, max_tokens=256)
    g.add_argument("--top-p", type=arg_types.unit_interval, default=0.0,
                   help="nucleus sampling, in [0, 1] (0 = off)")
    g.add_argument("--top-k", type=arg_types.non_negative_int, default=0,
                   help="sample from the k likeliest tokens, >= 0 (0 = off)")
    g.add_argument("--min-p", type=arg_types.unit_interval, default=0.0,
                   help="drop tokens below this share of the top one, in [0, 1] (0 = off)")
    g.add_argument("--seed", type=arg_types.seed, default=None, help="in [0, 2^64)")
    g.add_argument("--stop", type=arg_types.non_empty, action="append",
                   help="stop string (repeatable)")
    out = g.add_mutually_exclusive_group()  # constrained decoding (engine/constraint.py)
    out.add_argument("--json-schema", metavar="FILE",
                     help="the answer is JSON valid under this JSON schema file")
    out.add_argument("--json-object", action="store_true", help="the answer is a JSON object")
    out.add_argument("--regex", type=arg_types.non_empty, help="the answer matches this regex")
    out.add_argument("--grammar", metavar="FILE",
                     help="the answer follows this Lark (or llama.cpp GBNF) grammar file")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    add_scope_args(g)
    add_engine_args(g)
    add_distributed_args(g)
    g.set_defaults(func=cmd_generate)

    ch = sub.add_parser("chat", help="the terminal chat (the default command)")
    add_sampling_args(ch, max_tokens=512, typed_only=True)
    add_context_args(ch, default="summarize",
                     budget_help="prompt tokens a conversation may take before its policy "
                                 "applies (default: a quarter of the model's context)")
    add_engine_args(ch)
    ch.set_defaults(func=cmd_chat)

    c = sub.add_parser("convert", help="convert a GGUF (default: the embedded model) to MLX")
    c.add_argument("--model", default=None)
    c.set_defaults(func=cmd_convert)

    from app import ask, bench, cache_cli, estimate, server

    ask.add_parser(sub)
    estimate.add_parser(sub)
    server.add_parser(sub)
    bench.add_parser(sub)
    from app.eval import add_parser as add_eval_parser

    add_eval_parser(sub)
    cache_cli.add_parser(sub)
    from app.dev import make_model

    make_model.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; user errors print one ``kvchat: error:`` line and return 2."""
    argv = sys.argv[1:] if argv is None else list(argv)
    # The variable above only counts when transformers is imported after it; the logger
    # level also covers a transformers that something imported first.
    logging.getLogger("transformers").setLevel(logging.ERROR)
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
        argv = ["chat", *argv]  # `kvchat [chat flags]` opens the chat
    try:
        args = make_parser().parse_args(argv)
        return args.func(args)
    except (UsageError, KVChatError, ValueError, OSError) as e:
        print(f"kvchat: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kvchat: interrupted", file=sys.stderr)
        return 130


def _one_line(error: Exception) -> str:
    # An OS or library message can span lines; the contract is one line on stderr. A file
    # name may hold terminal escape sequences: shown escaped, never acting on the terminal.
    text = " ".join(str(error).split()) or type(error).__name__
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


if __name__ == "__main__":
    sys.exit(main())
