"""Continuous batching: which requests run this step, admission by free blocks, preemption.

The scheduler owns the waiting / running / swapped queues and the block
bookkeeping of each step; the engine executes what it plans. Order is always
(priority, time): interactive before background, then first come first served.
When running sequences need blocks that are not there, the lowest-priority,
most recently started sequence is preempted (recompute, or a swap to host
memory when the engine has room for it) — never an out-of-memory crash.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from engine.kvcache.block_manager import BlockManager, SlotPlan
from engine.request import Request, RequestState


@dataclass(slots=True)
class SchedulerConfig:
    max_running: int = 16
    """Sequences decoding or prefilling at once."""
    max_prefill_tokens: int = 512
    """Prompt tokens prefilled per step (over all requests): bounds a step's latency."""
    prefill_chunk: int = 512
    """Largest prefill forward of one request."""
    max_prefill_tokens_decoding: int = 128
    """The prefill budget of a step in which other sequences decode (their latency)."""
    watermark_blocks: int = 1
    """Blocks kept free at admission so running sequences can grow."""


@dataclass(slots=True)
class StepPlan:
    """What one engine step runs. Slots are already reserved in the block manager."""

    prefills: list[tuple[Request, int, SlotPlan]] = field(default_factory=list)
    decodes: list[tuple[Request, SlotPlan]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)
    swapped_in: list[Request] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decodes


def order_key(req: Request) -> tuple:
    return (req.priority, req.arrival, req.request_id)


class Scheduler:
    """Plans engine steps over a shared block pool."""

    def __init__(self, blocks: BlockManager, config: SchedulerConfig, engine_hooks):
        self.blocks = blocks
        self.config = config
        self.hooks = engine_hooks  # preempt(req) -> None, swap_in(req) -> bool, can_swap(req)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.swapped: list[Request] = []

    # -- queues ------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.waiting.append(req)
        self.waiting.sort(key=order_key)

    def remove(self, req: Request) -> None:
        for q in (self.waiting, self.running, self.swapped):
            if req in q:
                q.remove(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def free_blocks(self) -> int:
        return self.blocks.num_free_blocks

    # -- block needs ---------------------------------------------------------------
    def _prefill_len(self, req: Request, budget: int) -> int:
        left = req.total_len - 1 - req.num_computed
        return min(left, self.config.prefill_chunk, budget)

    def _pending_prefill_blocks(self) -> int:
        """Blocks the running prefills will still take: kept out of admission."""
        need = 0
        for r in self.running:
            if r.in_prefill:
                have = len(self.blocks.block_tables.get(r.request_id, ()))
                need += max(0, self.blocks.blocks_needed(r.total_len) - have)
        return need

    # -- planning --------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.config.max_prefill_tokens
        if any(not r.in_prefill for r in self.running):
            budget = min(budget, self.config.max_prefill_tokens_decoding)
        self.running.sort(key=lambda r: (r.priority, r.started, r.request_id))
        i = 0
        while i < len(self.running):
            req = self.running[i]
            n = 1 if not req.in_prefill else self._prefill_len(req, budget)
            if n == 0:
                i += 1
                continue
            while not self.blocks.can_append(req.request_id, n):
                victim = self.running[-1]
                self._preempt(victim, plan)
                if victim is req:
                    break
            if req.finished or req.state is not RequestState.RUNNING:
                continue  # preempted itself; the list shrank under it
            slots = self.blocks.append(req.request_id, n)
            if req.in_prefill:
                plan.prefills.append((req, n, slots))
                budget -= n
            else:
                plan.decodes.append((req, slots))
            i += 1
        if not plan.preempted:
            self._swap_in(plan)
            self._admit(plan, budget)
        return plan

    def _preempt(self, victim: Request, plan: StepPlan) -> None:
        self.running.remove(victim)
        self.hooks.preempt(victim)  # frees its blocks; state -> WAITING or SWAPPED
        if victim.state is RequestState.SWAPPED:
            self.swapped.append(victim)
            self.swapped.sort(key=order_key)
        else:
            self.add(victim)
        plan.preempted.append(victim)

    def _room(self) -> int:
        reserve = self._pending_prefill_blocks()
        reserve += self.config.watermark_blocks if self.running else 0
        return self.free_blocks() - reserve

    def _swap_in(self, plan: StepPlan) -> None:
        while self.swapped and len(self.running) < self.config.max_running:
            req = self.swapped[0]
            if self.blocks.blocks_needed(req.num_computed) + 1 > self._room():
                return
            self.swapped.pop(0)
            self.hooks.swap_in(req)
            req.started = time.perf_counter()
            self.running.append(req)
            plan.swapped_in.append(req)

    def _admit(self, plan: StepPlan, budget: int) -> None:
        while self.waiting and len(self.running) < self.config.max_running:
            if self.swapped and order_key(self.swapped[0]) < order_key(self.waiting[0]):
                return  # a preempted request of higher standing resumes first
            req = self.waiting[0]
            need = self.hooks.blocks_to_admit(req)
            if need > self._room() and not self._make_room_for(req, need, plan):
                return
            self.waiting.pop(0)
            self.hooks.admit(req)  # allocates the sequence (and reuses cached prefix blocks)
            req.state = RequestState.RUNNING
            req.started = time.perf_counter()
            self.running.append(req)
            plan.admitted.append(req)
            n = self._prefill_len(req, budget)
            if n > 0 and req.in_prefill:
                if not self.blocks.can_append(req.request_id, n):
                    continue  # its blocks come next step
                plan.prefills.append((req, n, self.blocks.append(req.request_id, n)))
                budget -= n

    def _make_room_for(self, req: Request, need: int, plan: StepPlan) -> bool:
        """Preempt running requests of strictly lower priority until ``req`` fits."""
        lower = [r for r in self.running if r.priority > req.priority]
        freeable = sum(len(self.blocks.block_tables.get(r.request_id, ())) for r in lower)
        if need > self._room() + freeable:
            return False
        while need > self._room() and lower:
            victim = max(lower, key=lambda r: (r.priority, r.started))
            lower.remove(victim)
            # its planned step is dropped: the plan must not run a preempted sequence
            plan.prefills = [p for p in plan.prefills if p[0] is not victim]
            plan.decodes = [d for d in plan.decodes if d[0] is not victim]
            self._preempt(victim, plan)
        return need <= self._room()
