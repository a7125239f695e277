"""`--distributed` for `kvchat generate` and `kvchat serve`: one model over several ranks.

Every rank runs the same command line (as `mlx.launch` starts it). Rank 0 goes on as the
command does, over a `DistributedEngine`; every other rank loads its part of the model and
serves rank 0's steps until rank 0 stops (`run_if_worker` returns its exit status). A rank
lost mid-run ends every rank with exit status 3 and one error line.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from app import arg_types
from app.engine_config import config_from_args

if TYPE_CHECKING:
    from engine.distributed import ParallelConfig

_group = None  # the joined group: init happens once per process


def _split(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be layer counts like 15,15, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"every rank needs >= 1 layer, got {text!r}")
    return values


def add_distributed_args(p: argparse.ArgumentParser) -> None:
    """--distributed and its options."""
    g = p.add_argument_group("distributed (run every rank with mlx.launch; see README)")
    g.add_argument("--distributed", action="store_true",
                   help="serve the model from several ranks over mx.distributed")
    g.add_argument("--parallel", choices=["pipeline", "tensor"], default="pipeline",
                   help="pipeline: a slice of layers per rank; tensor: a share of heads "
                        "(needs heads, KV heads and MLP width divisible by the ranks)")
    g.add_argument("--layer-split", type=_split, default=None, metavar="N,N,...",
                   help="pipeline: layers per rank in rank order (default: even)")
    g.add_argument("--dist-timeout", type=arg_types.int_in(1, 3600), default=60,
                   metavar="SECONDS", help="a rank silent this long ends the run (60)")
    g.add_argument("--dist-init-timeout", type=arg_types.int_in(1, 3600), default=180,
                   metavar="SECONDS",
                   help="for the ranks to connect and load their parts of the model (180)")
    g.add_argument("--dist-backend", choices=["ring", "jaccl", "mpi", "any"], default="ring",
                   help="MLX backend (ring: TCP over Ethernet or Thunderbolt)")


def parallel_from_args(args: argparse.Namespace) -> ParallelConfig:
    from engine.distributed import ParallelConfig

    return ParallelConfig(mode=args.parallel, split=args.layer_split,
                          timeout_s=float(args.dist_timeout),
                          init_timeout_s=float(args.dist_init_timeout),
                          backend=args.dist_backend)


def join(args: argparse.Namespace):
    """The process group (joined on first use, within the init timeout)."""
    global _group
    if _group is None:
        from engine.distributed import init_group

        parallel = parallel_from_args(args)
        _group = init_group(parallel.backend, timeout_s=parallel.init_timeout_s)
    return _group


def run_if_worker(args: argparse.Namespace) -> int | None:
    """On a rank other than 0: serve rank 0 and return the exit status; else None."""
    if not getattr(args, "distributed", False):
        return None
    group = join(args)
    if group.rank() == 0:
        return None
    from engine import load_model
    from engine.distributed.worker import run_worker

    parallel = parallel_from_args(args)
    loaded = load_model(args.model, weights=args.weights, tiled=tiles_allowed(parallel))
    return run_worker(loaded, config_from_args(args), group, parallel)


def build_distributed_engine(args: argparse.Namespace, config):
    """Rank 0's `DistributedEngine` for the flags and ``config``."""
    from engine import load_model
    from engine.distributed.engine import DistributedEngine

    group = join(args)
    parallel = parallel_from_args(args)
    return DistributedEngine(load_model(args.model, weights=args.weights,
                                        tiled=tiles_allowed(parallel)), config, group, parallel)


def tiles_allowed(parallel) -> bool:
    """Whether weights may be tiled: tensor parallel slices them by columns, as MLX lays
    them out (mlx-lm's sharding), which the CPU extension's tiles do not allow."""
    return parallel.mode != "tensor"


def rank_lines(engine) -> list[str]:
    """One line per rank from the engine's final reports (nothing without them)."""
    lines = []
    for r in getattr(engine, "final_reports", None) or []:
        lines.append(f"rank {r.rank}: layers {r.layer_start}-{r.layer_stop - 1}, "
                     f"{r.kv_heads} KV heads, {r.bytes_per_token} B/token, "
                     f"{r.pool_bytes / 2**20:.0f} MiB pool; blocks {r.blocks_used} used, "
                     f"{r.blocks_cached} cached, {r.blocks_free} free; "
                     f"{r.blocks_touched} written, {r.writes_outside} outside")
    return lines


def print_rank_lines(engine, *, prefix: str = "kvchat") -> None:
    for line in rank_lines(engine):
        print(f"{prefix}: {line}", file=sys.stderr)
