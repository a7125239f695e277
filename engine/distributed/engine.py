"""Rank 0's engine: the whole scheduler, block tables and prefix index, and a part of the model.

`DistributedEngine` is an `Engine` built over rank 0's part of the model (its layer slice,
or its share of heads), so its pool holds only that part's K/V; its runner and pool are built
first and wrapped (`engine.distributed.leader`) to drive the other ranks each step, and the
engine is constructed over the wrapped parts. Requests, cancels,
timeouts and shutdown go through the unchanged engine: every release is bookkeeping on rank
0 that the next message carries to every rank (`engine.distributed.ledger`).

Preemption by swapping K/V to host is not mirrored across ranks: it recomputes instead (with
a notice). The disk prefix store is per rank (`engine.distributed.prefix`).
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx

from engine.config import EngineConfig
from engine.distributed import handshake
from engine.distributed.config import ParallelConfig
from engine.distributed.group import Watchdog, on_fatal
from engine.distributed.leader import Leader, MirroredKV, PipelineRunner, TensorRunner
from engine.distributed.ledger import RankReport
from engine.distributed.link import Link
from engine.distributed.plan_wire import Op
from engine.distributed.prefix import LeaderPrefixCache
from engine.distributed.stage import layer_split, prepare_rank
from engine.engine import Engine
from engine.model.loader import LoadedModel
from engine.wiring import build_kv


def rank_config(config: EngineConfig, *, part_layers: int, max_layers: int,
                ) -> tuple[EngineConfig, list[str]]:
    """Rank 0's engine config: swap and speculation (not mirrored) off, the KV budget scaled so
    that rank 0 gets the block count the rank with the most layers can hold."""
    notices = []
    # pipelined steps may be built twice: the other ranks would run both
    changes: dict = {"preempt_mode": "recompute", "speculate": "off", "pipeline": False}
    if config.preempt_mode == "swap":
        notices.append("distributed: preemption recomputes (swapping K/V to host is not "
                       "mirrored across ranks)")
    if config.speculate != "off":  # a rejected draft's slots going back is not mirrored
        notices.append("distributed: speculative decoding is off")
    if part_layers < max_layers:
        changes["kv_budget_bytes"] = config.kv_budget_bytes * part_layers // max_layers
    return dataclasses.replace(config, **changes), notices


class DistributedEngine(Engine):
    """An `Engine` on rank 0 whose steps run across every rank of ``group``.

    Raises:
        KVChatError: the model cannot be split as asked, or a rank refuses the pool
            (another model, another format, no room).
    """

    def __init__(self, loaded: LoadedModel, config: EngineConfig | None,
                 group: mx.distributed.Group, parallel: ParallelConfig):
        config = config or EngineConfig()
        if group.rank() != 0:
            raise ValueError("DistributedEngine runs on rank 0; other ranks run a Worker")
        full_fingerprint = loaded.fingerprint
        num_layers = len(loaded.model.model.layers)
        stage, part = prepare_rank(loaded, group, parallel)
        sizes = [b - a for a, b in layer_split(num_layers, group.size(), parallel.split)]
        part_layers = part.layer_stop - part.layer_start
        config, notices = rank_config(config, part_layers=part_layers,
                                      max_layers=part_layers if part.mode == "tensor"
                                      else max(sizes))
        # rank 0's own parts, wrapped before the scheduler and executor take them
        parts = build_kv(stage, config)
        parts.shifter.refuse("context shift does not run across ranks (--distributed): only "
                             "rank 0's pooled keys would move")
        link = Link(group, Watchdog(parallel.timeout_s, rank=0))
        self.leader = leader = Leader(link, parts.blocks, part, parts.kv)
        runner_cls = TensorRunner if part.mode == "tensor" else PipelineRunner
        prefix = parts.prefix
        if prefix.store is not None:  # every rank keeps its part of each disk block
            prefix = LeaderPrefixCache(prefix, leader)
        parts = dataclasses.replace(parts, runner=runner_cls(parts.runner, part, leader),
                                    kv=MirroredKV(parts.kv, leader), prefix=prefix,
                                    notices=parts.notices + notices)
        super().__init__(stage, config, parts=parts)
        self.parallel, self.part = parallel, part
        self.final_reports: list[RankReport] | None = None
        hello = handshake.Hello(part.mode, group.size(), self.kv.num_blocks, self.layout,
                                self.runner.use_kernels, full_fingerprint,
                                disk=self.prefix.store is not None)
        reply = self.leader.exchange(Op.HELLO, handshake.encode_hello(hello),
                                     what="greeting the other ranks",
                                     timeout_s=parallel.init_timeout_s)
        handshake.raise_refusals(reply.payload, handshake.decode_hello(reply.payload)[1])
        on_fatal(self._release_all)

    def _release_all(self) -> str:
        """Before a fatal exit: end every request and give all of rank 0's blocks back."""
        with self._lock:
            live = list(self._requests.values())
        for req in live:
            self._finish(req, "error", error="a rank was lost")
        self.blocks.drop_cached()
        b = self.blocks
        return (f"rank 0 released its KV pool ({len(live)} requests ended, "
                f"{b.num_free_blocks} of {b.num_blocks} blocks free)")

    def rank_reports(self) -> list[RankReport]:
        """Every rank's pool accounting now (rank 0's from its block manager), between
        steps; the other ranks' ledgers include every release made so far."""
        with self._step_lock:
            return self.leader.reports()

    def _close(self) -> None:
        super()._close()
        # the last message: every rank reports its accounting and exits
        self.final_reports = self.leader.reports(stop=True)
