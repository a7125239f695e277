"""A speculating engine's next draft-free step, built before the last step's tokens are read.

A plain greedy engine launches each decode step on the previous step's unread tokens
(`StepExecutor.run`), so the next graph is built while the last one computes. A speculating
engine reads first, as its drafts follow the token, and so built every step's graph on the
serial path (~0.6 ms of a ~11 ms step on the 2-core Xeon). Yet a step without drafts is
mostly followed by another: `build` makes that step's graph (fed the unread tokens, the
pool's stores snapshotted) before the read, and `StepExecutor.run` launches it only when the
plan, made after the read as before, is exactly that step; else the graph is dropped and its
K/V writes undone. What is drafted does not change, only when the graph is built.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import mlx.core as mx

from engine import greedy
from engine.outcome import Flight
from engine.request import Request
from engine.scheduler import StepPlan
from engine.step_inputs import build_batch


@dataclass
class Ahead:
    """A built, unlaunched decode step of ``requests``, one token each into ``slots``."""

    requests: list[Request]
    slots: list[int]
    tokens: mx.array  # (B,) lazy picks, as a chained plain step's
    logits: mx.array
    snap: tuple | None  # the pool's stores before its writes (None once launched)
    after: list  # and with them (`PagedKVCache.arrays`, flat)

    def undo(self, kv) -> None:
        """Put the pool's stores back as they were before this step's writes, unless
        something wrote on top of them since (a context shift): then its writes stay, at
        the next position of each of its sequences (in a block of that sequence alone),
        where that sequence's next step writes again before anything reads."""
        if all(a is b for a, b in zip(stores(kv), self.after, strict=True)):
            kv.restore(self.snap)
        self.snap = None

    def fits(self, plan: StepPlan) -> bool:
        """``plan`` decodes exactly these requests into these slots, and nothing else, and
        each one's next token is still the argmax alone (a thinking budget may force one)."""
        return (not (plan.prefills or plan.preempted or plan.admitted or plan.failed)
                and len(plan.decodes) == len(self.requests)
                and all(r is q and not r.draft and not s.copies and s.slots == [slot]
                        and r.decoder.greedy
                        for (r, s), q, slot in zip(plan.decodes, self.requests, self.slots,
                                                   strict=True)))


def build(executor, wanted: bool = True) -> Ahead | None:
    """The next decode step of the executor's flight on its unread tokens (any step built
    before and never launched is undone first), or None: not ``wanted``, or the plan could
    not be that step (a token that opens or shares a block: the scheduler would allocate or
    copy it), or a pool whose writes cannot be undone."""
    if executor.ahead is not None and executor.ahead.snap is not None:
        executor.ahead.undo(executor.kv)
    if not wanted:
        return None
    flight, blocks = executor.flight, executor.blocks
    if flight is None or not executor.fast_chain:
        return None
    bs, ids_of, slots = blocks.block_size, [r.request_id for r in flight.requests], []
    for r in flight.requests:  # one cancelled since its launch has no blocks any more
        n, table = blocks.num_tokens.get(r.request_id), blocks.block_tables.get(r.request_id)
        if (r.finished or n is None or not table or n // bs >= len(table)
                or blocks.ref_counts[table[-1]] > 1):
            return None
        slots.append(blocks.slots(r.request_id, n, n + 1)[0])
    kv = executor.kv
    snap = kv.snapshot()
    ids = mx.maximum(flight.tokens, 0)[:, None].astype(mx.int32)  # -1 (unsure): dropped
    try:
        logits = executor.runner(build_batch(blocks, ids_of, ids, [[s] for s in slots], 1), kv)
    except Exception:  # noqa: BLE001 - built again after the read, its error the step's own
        kv.restore(snap)
        return None
    return Ahead(list(flight.requests), slots, greedy.lazy(logits, fast=True), logits, snap,
                 stores(kv))


def stores(kv) -> list:
    """Every store of the pool, flat."""
    return [a for side in kv.arrays for a in side]


def launch(executor, plan: StepPlan, read_as_fed: bool) -> bool:
    """Launch the executor's step built ahead if ``plan`` is that step and the tokens it was
    fed are the ones read (``read_as_fed``: none settled after the pick declined it); else
    undo its K/V writes. True when launched (its tokens then come with the next read)."""
    built, executor.ahead = executor.ahead, None
    ok = read_as_fed and executor.flight is None and built.fits(plan)
    if not ok:
        built.undo(executor.kv)
    built.snap = None  # held, the old stores would be copied, not written in place
    rec = executor.recorder
    rec.ahead_launched, rec.ahead_dropped = rec.ahead_launched + ok, rec.ahead_dropped + (not ok)
    if ok:
        mx.async_eval(built.tokens, *executor.kv.arrays)
        executor.flight = Flight(built.requests, built.tokens, time.perf_counter(), built.logits)
    return ok
