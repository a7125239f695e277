"""Ranks other than 0: hold a part of the model and a pool for it, run what rank 0 plans.

A worker has no scheduler, no block manager and no tokenizer use: it applies the block
ledger rank 0 sends, writes the slots it is told, and passes hidden states on (pipeline)
or meets the other ranks in the layers' all-sums (tensor). It waits for rank 0's next
message as long as the run is idle; once a message starts, every exchange is under the
watchdog. When rank 0 goes away, its socket closes and the worker exits with an error.
"""

from __future__ import annotations

import dataclasses
import signal
import threading

import mlx.core as mx
import numpy as np

from engine.config import EngineConfig
from engine.distributed import handshake
from engine.distributed import plan_wire as wire
from engine.distributed.config import ParallelConfig
from engine.distributed.group import Watchdog, fatal
from engine.distributed.ledger import BlockLedger, RankReport
from engine.distributed.link import Link
from engine.distributed.plan_wire import Message, Op
from engine.distributed.prefix import RankStore, fold_count, rank_store_dir
from engine.distributed.stage import StageModel, prepare_rank
from engine.kvcache.disk.store import DiskPrefixStore
from engine.kvcache.kv_cache import PagedKVCache
from engine.kvcache.prefix_key import salt_base
from engine.kvcache.residual import ResidualKVCache
from engine.model.loader import LoadedModel
from engine.model.model_runner import PagedModel
from engine.wiring import check_kv_budget, kv_writers, residual_writers


class Worker:
    """One non-zero rank's part, pool and ledger, and the loop over rank 0's messages."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig, group: mx.distributed.Group,
                 parallel: ParallelConfig):
        self.rank = group.rank()
        self.watchdog = Watchdog(parallel.timeout_s, rank=self.rank)
        self.link = Link(group, self.watchdog)
        self.parallel = parallel
        self.full_fingerprint = loaded.fingerprint
        stage, self.part = prepare_rank(loaded, group, parallel)
        self.loaded = stage
        self.paged = PagedModel(stage.model, stage.model_type)
        self.paged.use_kernels = config.kernels
        if config.fuse_projections:
            self.paged.fuse_projections()
        self.stage = StageModel(self.paged, self.part)
        self.config = config
        self.weight_bytes = stage.weight_bytes
        self.kv: PagedKVCache | None = None
        self.ledger: BlockLedger | None = None
        self.store: RankStore | None = None

    # -- the start ---------------------------------------------------------------------
    def greet(self) -> bool:
        """Take rank 0's hello, build the pool, pass the answers on; False if refused."""
        msg = self.link.recv(self.link.prev, idle=True, what="waiting for rank 0's hello")
        hello, _ = handshake.decode_hello(msg.payload)
        error = handshake.check(hello, world=self.link.size, mode=self.part.mode,
                                fingerprint=self.full_fingerprint,
                                head_dim=self.paged.head_dim)
        if not error:
            try:
                self._build_pool(hello)
            except Exception as e:  # noqa: BLE001 - said to rank 0, which ends the run
                error = f"cannot build its KV pool: {e}"
        self._pass_on(Message(Op.HELLO, msg.seq, handshake.answer(msg.payload, self.rank,
                                                                  error)))
        return not error

    def _build_pool(self, hello: handshake.Hello) -> None:
        layout = dataclasses.replace(hello.layout, num_layers=len(self.paged.layers),
                                     num_kv_heads=self.paged.num_kv_heads)
        check_kv_budget(hello.num_blocks * layout.bytes_per_block, self.weight_bytes)
        self.ledger = BlockLedger(hello.num_blocks, layout.block_size)
        if layout.residual:  # as rank 0's, its filling blocks' rows freed by the ledger
            self.kv = ResidualKVCache(layout, hello.num_blocks,
                                      **residual_writers(self.loaded),
                                      free_ids=self.ledger.free_ids)
        else:
            self.kv = PagedKVCache(layout, hello.num_blocks, **kv_writers(self.loaded))
        self.paged.use_kernels = hello.use_kernels
        if hello.disk:
            c, m = self.config, self.loaded
            store = DiskPrefixStore(rank_store_dir(c.disk_cache_dir, self.rank),
                                    budget_bytes=c.disk_budget_bytes,
                                    default_ttl_s=c.disk_ttl_s, max_pending=256,
                                    hold=lambda: bool((self.ledger.refs > 0).any()))  # as rank 0
            base = salt_base(model_fingerprint=m.fingerprint,
                             tokenizer_fingerprint=m.tokenizer_fingerprint,
                             chat_template=getattr(m.tokenizer, "chat_template", None),
                             model_config=m.config, kv_format=layout.kv_format,
                             block_size=layout.block_size)
            self.store = RankStore(store, base, self.kv)

    def _forward_only(self, msg: Message) -> None:
        """To the next rank; the last one answers nothing (rank 0 does not wait)."""
        if not self.link.is_last:
            self.link.send(self.link.next, msg)

    def _pass_on(self, msg: Message) -> None:
        """To the next rank, or as the reply to rank 0 from the last one."""
        if self.link.is_last:
            msg = Message(Op.REPLY, msg.seq, msg.payload, tensor=msg.tensor)
        self.link.send(self.link.next, msg)

    # -- the loop ----------------------------------------------------------------------
    def serve(self) -> int:
        """Run rank 0's messages until it says STOP; returns the exit status."""
        if not self.greet():
            return 2
        while True:
            msg = self.link.recv(self.link.prev, idle=True,
                                 what="receiving rank 0's next message")
            with self.watchdog.guard(f"handling {msg.op.name} #{msg.seq}"):
                try:
                    done = self._handle(msg)
                except Exception as e:  # noqa: BLE001 - the ranks cannot go on out of step
                    fatal(f"{msg.op.name} #{msg.seq} failed here: {type(e).__name__}: {e}",
                          rank=self.rank)
            if done:
                if self.store is not None:
                    self.store.close()  # drains its writer (no peer waits on it)
                return 0

    def _handle(self, msg: Message) -> bool:
        """Do what ``msg`` asks; True when the run is over (STOP)."""
        self.ledger.apply(msg.ledger)
        if msg.op in (Op.STEP, Op.PACKED):
            self._forward(msg)
        elif msg.op == Op.COPY:
            self.kv.copy_blocks(wire.decode_copies(msg.payload))
            self._pass_on(Message(Op.COPY, msg.seq, msg.payload, msg.ledger))
        elif msg.op == Op.PERSIST:
            self._forward_only(msg)
            if self.store is not None:
                self.store.persist(msg.payload)
        elif msg.op == Op.RESTORE_CHECK:
            payload = (self.store.check(msg.payload) if self.store is not None
                       else fold_count(msg.payload, 0))
            self._pass_on(Message(msg.op, msg.seq, payload, msg.ledger))
        elif msg.op == Op.RESTORE_COMMIT:
            self._forward_only(msg)
            if self.store is not None:
                self.store.commit(msg.payload)
        elif msg.op in (Op.REPORT, Op.STOP):
            rows = np.concatenate([msg.payload, self.report().to_array()])
            self._pass_on(Message(msg.op, msg.seq, rows, ledger=msg.ledger))
        else:
            raise ValueError(f"unexpected {msg.op.name} from rank 0")
        return msg.op == Op.STOP

    def _forward(self, msg: Message) -> None:
        if msg.op == Op.STEP:
            batch, want = wire.decode_step(msg.payload)
        else:
            batch = wire.decode_packed(msg.payload)
            want = bool(batch.decode_lens)
        kv = self.kv
        self.ledger.wrote(np.asarray(batch.slots))
        if self.part.mode == "tensor":
            # the plan goes on first: every rank must enter the layers' all-sums
            if not self.link.is_last:
                self.link.send(self.link.next, Message(msg.op, msg.seq, msg.payload,
                                                       msg.ledger))
            h = self.stage.hidden(batch, kv)
            self.link.eval(h, *kv.arrays, what=f"a {msg.op.name} forward")
            return
        h = self.stage.hidden(batch, kv, msg.tensor)
        if not self.link.is_last:
            mx.eval(h, *kv.arrays)
            self.link.send(self.link.next, Message(msg.op, msg.seq, msg.payload, msg.ledger,
                                                   h))
            return
        out = self.stage.logits(batch, h) if want else mx.zeros((1,), mx.int32)
        mx.eval(out, *kv.arrays)
        self.link.send(self.link.next, Message(Op.REPLY, msg.seq, tensor=out))

    def report(self) -> RankReport:
        used, cached, free = self.ledger.counts()
        L, a = self.kv.layout, self.ledger
        return RankReport(self.rank, self.part.layer_start, self.part.layer_stop,
                          L.num_kv_heads, self.kv.num_blocks, L.block_size, L.bytes_per_token,
                          used, cached, free, int(np.count_nonzero(a.touched)),
                          a.writes_outside, a.steps, a.tokens_written)


def run_worker(loaded: LoadedModel, config: EngineConfig, group: mx.distributed.Group,
               parallel: ParallelConfig) -> int:
    """Serve rank 0 until it stops the run; the process's exit status.

    Ctrl+C reaches every rank of a terminal's process group: a worker ignores it, so rank
    0 can drain and stop the run; it ends when rank 0 says STOP or goes away.
    """
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    return Worker(loaded, config, group, parallel).serve()
