"""Engine flags on the command line -> one `EngineConfig` -> one `Engine`.

Used by `kvchat generate`, `chat`, every `bench` mode and the TUI's default engine
factory, so a flag means the same thing everywhere and the config is built in one place
(`app.engine_config`). The engine is imported lazily: the bench worker imports app
modules and must never load it (its import preloads OpenBLAS process-wide).
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from app import arg_types
from app.arg_types import parse_size
from app.distributed import build_distributed_engine
from app.engine_config import config_from_args

if TYPE_CHECKING:
    from engine import Engine, EngineConfig

__all__ = ["add_engine_args", "add_scope_args", "build_engine", "load_engine", "parse_size"]

DEFAULT_KV_BUDGET = "1G"


class _Activations(argparse.Action):
    """``--activations``: applied as parsed, before any model loads (process-wide)."""

    def __call__(self, parser, namespace, values, option_string=None):
        from engine.model.cpu_ext import ops

        ops.request_activations(values)
        setattr(namespace, self.dest, values)


def add_engine_args(p: argparse.ArgumentParser, *, disk: bool = True) -> None:
    """Add --model, --block-size, --kv-budget, --weights (and the disk-cache flags)."""
    p.add_argument("--model", default=None,
                   help="'default', a model dir, a .gguf or a hub repo id")
    p.add_argument("--block-size", type=arg_types.block_size, default=16,
                   help="tokens per KV block, 1..1024 (16)")
    p.add_argument("--kv-budget", type=arg_types.size, default=parse_size(DEFAULT_KV_BUDGET),
                   help=f"bytes for the KV pool, e.g. 512M, 2G ({DEFAULT_KV_BUDGET})")
    p.add_argument("--weights", choices=["auto", "float32", "shipped", "q8", "q4"],
                   default="auto",
                   help="weight format: auto keeps the shipped Q4/Q8 (on CPU through "
                        "kvchat's extension; float32 where it cannot build) and quantizes a "
                        "float checkpoint over 1 GiB of float32 to q8; q8/q4 quantize float "
                        "weights at load (CPU)")
    p.add_argument("--activations", choices=["int16", "int8"], default=None,
                   action=_Activations,
                   help="how the CPU extension's quantized matmuls quantize activations: "
                        "int16 (default: ~float16 precision, token for token mlx-lm's "
                        "output) or int8 (llama.cpp's Q8_0 way: ~1.4x faster prefill on "
                        "AVX-512 VNNI, some perplexity; see the README)")
    p.add_argument("--kv-bits", type=int, choices=[16, 8, 4], default=None,
                   help="store the KV cache quantized at 8 or 4 bits (16: unquantized)")
    p.add_argument("--k-bits", type=int, choices=[16, 8, 4], default=None,
                   help="K's bits alone (overrides --kv-bits for K)")
    p.add_argument("--v-bits", type=int, choices=[16, 8, 4], default=None,
                   help="V's bits alone (overrides --kv-bits for V)")
    p.add_argument("--kv-kivi", action="store_true",
                   help="with --kv-bits/--k-bits/--v-bits: keep each block float16 until it "
                        "fills, then quantize it once, keys per channel (KIVI; the README's "
                        "held-out table); carries swap, the disk cache, speculation, context "
                        "shift and --distributed; sliding-window layers at head dim 64 or 128 "
                        "(the CPU extension's op)")
    p.add_argument("--no-kv-rotation", action="store_true",
                   help="store quantized K/V rows as they are (default: rotated first, "
                        "which keeps more of their precision)")
    p.add_argument("--speculate", type=arg_types.speculate, default="off",
                   metavar="{off,lookup,draft:MODEL}",
                   help="speculative decoding: lookup verifies draft tokens copied from "
                        "the prompt and answer so far, draft:MODEL tokens a smaller model "
                        "of the same tokenizer guesses (same greedy output; drafts only "
                        "while measured to pay off); off: one token per step (off)")
    p.add_argument("--context-shift", action="store_true",
                   help="an answer that fills the context goes on: the first --shift-sinks "
                        "tokens and the newest half stay, the middle is dropped and the kept "
                        "keys re-rotated (models with plain RoPE; off: it stops at the "
                        "context with finish_reason length)")
    p.add_argument("--shift-sinks", type=arg_types.int_in(0, 1 << 20), default=4,
                   help="tokens a context shift keeps at the start, rounded up to blocks (4)")
    p.add_argument("--max-context", type=arg_types.positive_int, default=None,
                   help="tokens one sequence may hold (default: the model's context)")
    p.add_argument("--full-window-layers", action="store_true",
                   help="sliding-window layers keep every block, as global ones do "
                        "(default: only the blocks their window covers)")
    if disk:
        p.add_argument("--cache-dir", default=None,
                       help="disk prefix cache directory (default ~/.cache/kvchat/prefix)")
        p.add_argument("--no-disk-cache", action="store_true",
                       help="keep prefix blocks in RAM only (nothing written to disk)")


def add_scope_args(p: argparse.ArgumentParser) -> None:
    """--tenant and --permission-version: whose prefix cache a request uses."""
    p.add_argument("--tenant", type=arg_types.tenant, default="local",
                   help="prefix-cache scope, 1..128 characters (default: local)")
    p.add_argument("--permission-version", type=arg_types.int_in(0, (1 << 63) - 1), default=0,
                   help="bump to make this tenant's older cached blocks unreachable (>= 0)")


def check_kv_budget(budget: int) -> None:
    """Refuse a KV pool larger than the memory the engine may use, before the slow load.

    The engine checks again once the weights' size is known (`engine.wiring`).
    """
    from engine.wiring import check_kv_budget as check

    check(budget, weight_bytes=0)


def load_engine(spec: str | None, *, weights: str = "auto",
                config: EngineConfig | None = None) -> Engine:
    """Load ``spec`` and build an `Engine` over it (not started)."""
    from engine import Engine, EngineConfig, load_model

    config = config or EngineConfig()
    check_kv_budget(config.kv_budget_bytes)  # before the slow load
    return Engine(load_model(spec, weights=weights), config)


def build_engine(args: argparse.Namespace, **overrides) -> Engine:
    """The engine the flags describe (see `add_engine_args`)."""
    if getattr(args, "distributed", False):  # rank 0 of a multi-rank run (app.distributed)
        config = config_from_args(args, **overrides)
        check_kv_budget(config.kv_budget_bytes)
        return build_distributed_engine(args, config)
    return load_engine(args.model, weights=args.weights,
                       config=config_from_args(args, **overrides))
