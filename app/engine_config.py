"""Engine flags (`app.engine_args.add_engine_args`) -> one `EngineConfig`.

Its own module because both sides of a run build it: the command's engine
(`app.engine_args.build_engine`) and, under ``--distributed``, every worker rank
(`app.distributed.run_if_worker`). The engine is imported lazily, as in `app.engine_args`.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine import EngineConfig


def config_from_args(args: argparse.Namespace, **overrides) -> EngineConfig:
    """The `EngineConfig` the flags describe; ``overrides`` set other fields (benchmarks)."""
    from engine import EngineConfig

    config = EngineConfig(
        block_size=args.block_size,
        kv_budget_bytes=args.kv_budget,
        disk_cache=not getattr(args, "no_disk_cache", True),
        disk_cache_dir=getattr(args, "cache_dir", None),
        kv_bits=getattr(args, "kv_bits", None),
        k_bits=getattr(args, "k_bits", None),
        v_bits=getattr(args, "v_bits", None),
        kv_rotation=not getattr(args, "no_kv_rotation", False),
        kv_residual=getattr(args, "kv_kivi", False),
        kv_key_channel=getattr(args, "kv_kivi", False),
        window_pool=not getattr(args, "full_window_layers", False),
        speculate=getattr(args, "speculate", "off"),
        context_shift=getattr(args, "context_shift", False),
        shift_sinks=getattr(args, "shift_sinks", 4),
        max_context=getattr(args, "max_context", None),
    )
    return dataclasses.replace(config, **overrides)
