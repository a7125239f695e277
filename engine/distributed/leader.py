"""Rank 0's side: runners the executor calls as it calls `PagedModel`, which also drive
the other ranks.

`PipelineRunner`: rank 0 embeds and runs its layers, then sends the step's plan and its
hidden states to rank 1; each rank runs its layers and passes on; the last rank computes
the logits and sends them back. `TensorRunner`: rank 0 sends the plan first, then every
rank runs every layer on its share of heads, the all-sums inside the layers keeping them in
step. Both have `PagedModel`'s call signatures, so the executor and the scheduler run
unchanged. `MirroredKV` repeats rank 0's block copies (copy-on-write) on every rank.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from engine.distributed import plan_wire as wire
from engine.distributed.group import fatal
from engine.distributed.ledger import BlockLedger, LedgerSender, RankReport
from engine.distributed.link import Link
from engine.distributed.plan_wire import Message, Op
from engine.distributed.stage import RankPart, StageModel
from engine.kvcache.block_manager import BlockManager
from engine.kvcache.kv_cache import PagedKVCache
from engine.model.model_runner import Interrupt, PagedModel, StepBatch
from engine.model.packed_batch import PackedBatch


class Leader:
    """Rank 0's end of the ring: numbered messages with the block-ledger delta, and replies."""

    def __init__(self, link: Link, blocks: BlockManager, part: RankPart, kv: PagedKVCache):
        self.link, self.part, self.kv = link, part, kv
        self.sender = LedgerSender(blocks)
        self.account = BlockLedger(blocks.num_blocks, blocks.block_size)  # rank 0's writes
        self.seq = 0

    def post(self, op: Op, payload: np.ndarray | None = None,
             tensor: mx.array | None = None) -> int:
        """Send a message to rank 1 (with the ledger delta); returns its number."""
        self.seq += 1
        msg = Message(op, self.seq, payload if payload is not None else np.zeros(0, np.int32),
                      self.sender.delta(), tensor)
        self.link.send(self.link.next, msg)
        return self.seq

    def reply(self, seq: int, what: str, timeout_s: float | None = None) -> Message:
        """The last rank's answer to message ``seq``."""
        msg = self.link.recv(self.link.prev, what=what, timeout_s=timeout_s)
        if msg.op != Op.REPLY or msg.seq != seq:
            fatal(f"ranks out of step: expected the reply to #{seq}, got {msg.op.name} "
                  f"#{msg.seq}", rank=0)
        return msg

    def exchange(self, op: Op, payload: np.ndarray | None = None,
                 tensor: mx.array | None = None, *, what: str,
                 timeout_s: float | None = None) -> Message:
        return self.reply(self.post(op, payload, tensor), what, timeout_s)

    def wrote(self, slots: mx.array) -> None:
        # rank 0 checks its writes against its block manager itself, the source of truth
        self.account.refs = np.asarray(self.sender.blocks.ref_counts, np.int32)
        self.account.wrote(np.asarray(slots))

    def own_report(self) -> RankReport:
        """Rank 0's accounting, from its block manager (the source of truth)."""
        refs, cached = self.sender.snapshot()
        used = int(np.count_nonzero(refs > 0))
        n_cached = int(np.count_nonzero((refs == 0) & cached))
        a, L = self.account, self.kv.layout
        return RankReport(0, self.part.layer_start, self.part.layer_stop, L.num_kv_heads,
                          self.kv.num_blocks, L.block_size, L.bytes_per_token, used, n_cached,
                          self.kv.num_blocks - used - n_cached,
                          int(np.count_nonzero(a.touched)), a.writes_outside, a.steps,
                          a.tokens_written)

    def reports(self, *, stop: bool = False) -> list[RankReport]:
        """Every rank's pool accounting; with ``stop`` the other ranks exit after it."""
        op = Op.STOP if stop else Op.REPORT
        msg = self.exchange(op, what=f"collecting the ranks' reports ({op.name})")
        rows = msg.payload.reshape(-1, len(self.own_report().to_array()))
        return [self.own_report()] + [RankReport.from_array(r) for r in rows]


class MirroredKV:
    """Rank 0's pool; a block copy is made on every rank (they hold the same block ids)."""

    def __init__(self, local: PagedKVCache, leader: Leader):
        self.local, self.leader = local, leader

    def __getattr__(self, name):
        return getattr(self.local, name)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        self.local.copy_blocks(copies)
        if copies:
            self.leader.exchange(Op.COPY, wire.encode_copies(copies),
                                 what="copying blocks on every rank")

    def take(self, slots):
        raise NotImplementedError("moving K/V out of the pool (swap, disk store) is not "
                                  "mirrored across ranks")

    put = take


def _local(kv) -> PagedKVCache:
    return kv.local if isinstance(kv, MirroredKV) else kv


class _Runner:
    """What the engine reads off a runner (embedding, layers, dtype...) comes from rank 0's
    `PagedModel`."""

    def __init__(self, paged: PagedModel, part: RankPart, leader: Leader):
        self.paged, self.leader = paged, leader
        self.stage = StageModel(paged, part)

    def __getattr__(self, name):
        return getattr(self.paged, name)


class PipelineRunner(_Runner):
    """Rank 0 of a pipeline: embed + its layers here, the rest on the other ranks."""

    def _run(self, op: Op, batch, payload: np.ndarray, kv, interrupt, group, want: bool):
        local = _local(kv)
        # an interrupt stops here, before anything is sent: the other ranks never see it
        h = self.stage.hidden(batch, local, interrupt=interrupt, group=group)
        mx.eval(h, *local.arrays)
        self.leader.wrote(batch.slots)
        msg = self.leader.exchange(op, payload, h, what=f"running a {op.name} on the "
                                                        "other ranks")
        return msg.tensor if want else None

    def __call__(self, batch: StepBatch, kv, *, logits: bool = True,
                 interrupt: Interrupt | None = None, group: int = 1):
        return self._run(Op.STEP, batch, wire.encode_step(batch, logits), kv, interrupt,
                         group, logits)

    def forward_packed(self, batch: PackedBatch, kv, *, interrupt: Interrupt | None = None,
                       group: int = 1):
        return self._run(Op.PACKED, batch, wire.encode_packed(batch), kv, interrupt, group,
                         bool(batch.decode_lens))


class TensorRunner(_Runner):
    """Rank 0 under tensor parallel: every rank runs every layer on its share of heads.

    No interrupt between layer groups: the ranks meet in an all-sum in every layer, so
    they must all run the same layers; a cancel lands after the forward instead.
    """

    def _run(self, op: Op, batch, payload: np.ndarray, kv, want: bool):
        local = _local(kv)
        self.leader.post(op, payload)
        link = self.leader.link
        with link.watchdog.guard(f"running a {op.name} with the other ranks"):
            h = self.stage.hidden(batch, local)
            out = self.stage.logits(batch, h) if want else None
            link.eval(out if out is not None else h, *local.arrays,
                      what=f"a {op.name} forward")
        self.leader.wrote(batch.slots)
        return out

    def __call__(self, batch: StepBatch, kv, *, logits: bool = True,
                 interrupt: Interrupt | None = None, group: int = 1):
        return self._run(Op.STEP, batch, wire.encode_step(batch, logits), kv, logits)

    def forward_packed(self, batch: PackedBatch, kv, *, interrupt: Interrupt | None = None,
                       group: int = 1):
        return self._run(Op.PACKED, batch, wire.encode_packed(batch), kv,
                         bool(batch.decode_lens))
