"""Continuous batching: which requests run this step, admission by free blocks, preemption.

The scheduler owns the waiting / running / swapped queues and every block a
request holds: it checks requests against the context and the pool, admits
them on their cached prefix, preempts, swaps in, and releases. Order is always
(priority, time): interactive before background, then first come first served.
When running sequences need blocks that are not there, the lowest-priority,
most recently started sequence is preempted (recompute, or a swap to host
memory while the swap budget has room) — never an out-of-memory crash.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from engine.errors import RequestError, RequestTooLargeError
from engine.kvcache.block_manager import BlockManager, SlotPlan
from engine.kvcache.prefix_cache import PrefixCache
from engine.kvcache.swap import HostSwap
from engine.pacing import StepPacer
from engine.request import Request, RequestState
from engine.shifting import ContextShifter


@dataclass(slots=True)
class SchedulerConfig:
    max_context: int
    """Tokens one sequence may hold (the model's context, or a smaller cap)."""
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
    preempt_mode: str = "recompute"
    """"recompute" or "swap" (to host, within the swap budget; else recompute)."""
    overflow: str = "truncate"
    """A request whose output cannot fit: "truncate" its max tokens or "reject"."""


@dataclass(slots=True)
class Admission:
    """A request admitted this step, on how many cached prompt tokens and from where."""

    request: Request
    cached_tokens: int
    source: str  # "none", "memory" or "disk"


@dataclass(slots=True)
class StepPlan:
    """What one engine step runs. Slots are already reserved in the block manager."""

    prefills: list[tuple[Request, int, SlotPlan]] = field(default_factory=list)
    decodes: list[tuple[Request, SlotPlan]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    admitted: list[Admission] = field(default_factory=list)
    failed: list[tuple[Request, str]] = field(default_factory=list)  # admission errors


def order_key(req: Request) -> tuple:
    return (req.priority, req.arrival, req.request_id)


class Scheduler:
    """Plans engine steps over a shared block pool and owns every request's blocks."""

    def __init__(self, blocks: BlockManager, prefix: PrefixCache, swap: HostSwap,
                 config: SchedulerConfig, pacer: StepPacer | None = None):
        self.blocks = blocks
        self.prefix = prefix
        self.swap = swap
        self.config = config
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        # sizes the prefill budget of steps with decodes from measured forwards; without
        # one, such a step prefills up to the config's fixed cap
        self.pacer = pacer
        self.shifter: ContextShifter | None = None  # context shift (the engine sets it)

    # -- checks ------------------------------------------------------------------
    def check(self, prompt_len: int, max_tokens: int, *,
              shift: bool = False) -> tuple[int, str | None]:
        """(max new tokens the request may produce, a notice if reduced); a request that
        shifts its context (`engine.shifting`) may produce any number.

        Raises `RequestTooLargeError` for a request that can never fit.
        """
        if prompt_len == 0:
            raise RequestError("the prompt is empty")
        ctx = self.config.max_context
        if prompt_len >= ctx:
            raise RequestTooLargeError(f"the prompt has {prompt_len} tokens; the context "
                                       f"holds {ctx}")
        pool = self.blocks.num_blocks * self.blocks.block_size
        if prompt_len >= pool:
            raise RequestTooLargeError(
                f"the prompt has {prompt_len} tokens; the KV pool holds {pool} "
                f"({self.blocks.num_blocks} blocks; raise the KV budget)")
        fits = min(ctx, pool) - prompt_len
        if max_tokens <= fits or shift:
            return max_tokens, None
        if self.config.overflow == "reject":
            raise RequestTooLargeError(
                f"{prompt_len} prompt + {max_tokens} new tokens exceed the "
                f"{'context' if ctx <= pool else 'KV pool'} ({min(ctx, pool)} tokens)")
        return fits, f"max_tokens reduced from {max_tokens} to {fits} to fit"

    # -- queues ------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.waiting.append(req)
        self.waiting.sort(key=order_key)

    def release(self, req: Request) -> int:
        """Take a request out of every queue and drop its blocks; the blocks released."""
        for q in (self.waiting, self.running, self.swapped):
            if req in q:
                q.remove(req)
        self.swap.drop(req.swap)
        req.swap = None
        return self.blocks.free(req.request_id)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    # -- block needs ---------------------------------------------------------------
    def can_plan_ahead(self) -> bool:
        """Whether the next plan may be made before a launched step's tokens are applied:
        nothing waits or is swapped out, and every running sequence can grow a block, so
        `schedule` cannot preempt a sequence whose token is still in flight."""
        return (not self.waiting and not self.swapped and self.blocks.num_free_blocks
                > len(self.running) + self.config.watermark_blocks)

    def _prefill_len(self, req: Request, budget: int) -> int:
        left = req.kv_len - 1 - req.num_computed
        return min(left, self.config.prefill_chunk, budget)

    def _pending_prefill_blocks(self) -> int:
        """Blocks the running prefills will still take: kept out of admission."""
        need = 0
        for r in self.running:
            if r.in_prefill:
                have = len(self.blocks.block_tables.get(r.request_id, ()))
                need += max(0, self.blocks.blocks_needed(r.kv_len) - have)
        return need

    def _blocks_to_admit(self, req: Request) -> int:
        """Free blocks the request needs: cached prefix blocks in use elsewhere cost none."""
        hits = self.prefix.ram_hits(req.prefix, req.all_ids)
        shared = sum(1 for b in hits if self.blocks.ref_counts[b] > 0)
        return self.blocks.blocks_needed(req.kv_len) - shared

    def _room(self) -> int:
        reserve = self._pending_prefill_blocks()
        reserve += self.config.watermark_blocks if self.running else 0
        return self.blocks.num_free_blocks - reserve

    # -- planning --------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.config.max_prefill_tokens
        if any(not r.in_prefill for r in self.running):
            cap = self.config.max_prefill_tokens_decoding
            budget = min(budget, self.pacer.decoding_budget(cap) if self.pacer else cap)
        self.running.sort(key=lambda r: (r.priority, r.started, r.request_id))
        i = 0
        while i < len(self.running):
            req = self.running[i]
            error = self.shifter and not req.in_prefill and self.shifter.make_room(req)
            if error:  # its step is not planned: the engine ends it
                plan.failed.append((req, error))
                i += 1
                continue
            n = 1 + len(req.draft) if not req.in_prefill else self._prefill_len(req, budget)
            if n == 0:
                i += 1
                continue
            while not self.blocks.can_append(req.request_id, n):
                if n > 1 and not req.in_prefill:  # its drafts go before anyone's blocks
                    req.draft, n = [], 1
                    continue
                victim = self.running[-1]
                self._preempt(victim, plan)
                if victim is req:
                    break
            if req.state is not RequestState.RUNNING:
                continue  # preempted itself; the list shrank under it
            slots = self.blocks.append(req.request_id, n)
            if req.in_prefill:
                plan.prefills.append((req, n, slots))
                budget -= n
            else:
                plan.decodes.append((req, slots))
            i += 1
        if not plan.preempted:
            self._swap_in()
            self._admit(plan, budget)
        return plan

    def _preempt(self, victim: Request, plan: StepPlan) -> None:
        """Give back a running request's blocks: swap them to host, or recompute later."""
        self.running.remove(victim)
        victim.stats.preemptions += 1
        victim.draft = []
        if (self.config.preempt_mode == "swap"
                and self.swap.can_swap_out(victim.num_computed)):
            victim.swap = self.swap.swap_out(victim.request_id, victim.num_computed)
            victim.state = RequestState.SWAPPED
            self.swapped.append(victim)
            self.swapped.sort(key=order_key)
        else:
            self.blocks.free(victim.request_id)
            victim.num_computed = victim.prefix.registered = 0
            victim.state = RequestState.WAITING
            self.add(victim)
        plan.preempted.append(victim)

    def _swap_in(self) -> None:
        while self.swapped and len(self.running) < self.config.max_running:
            req = self.swapped[0]
            if self.blocks.blocks_needed(req.num_computed) + 1 > self._room():
                return
            self.swapped.pop(0)
            self.swap.swap_in(req.request_id, req.swap)
            req.swap = None
            req.state = RequestState.RUNNING
            req.started = time.perf_counter()
            self.running.append(req)

    def _admit(self, plan: StepPlan, budget: int) -> None:
        while self.waiting and len(self.running) < self.config.max_running:
            if self.swapped and order_key(self.swapped[0]) < order_key(self.waiting[0]):
                return  # a preempted request of higher standing resumes first
            req = self.waiting[0]
            try:  # a lookup or disk restore that fails fails this request alone
                need = self._blocks_to_admit(req)
                if need > self._room() and not self._make_room_for(req, need, plan):
                    return
                self.waiting.pop(0)
                cached, source = self.prefix.admit(req.request_id, req.prefix, req.all_ids)
            except Exception as e:  # noqa: BLE001
                self.release(req)
                plan.failed.append((req, f"{type(e).__name__}: {e}"))
                continue
            req.num_computed = cached
            req.state = RequestState.RUNNING
            req.started = time.perf_counter()
            self.running.append(req)
            plan.admitted.append(Admission(req, cached, source))
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
