"""The scheduler alone: a real BlockManager, a tiny real pool, no model.

A step is simulated the way the engine applies executor outcomes: a planned
prefill computes its tokens, a planned decode computes one and samples one.
"""

from __future__ import annotations

import itertools

import mlx.core as mx
import pytest

from engine.decoder import Decoder
from engine.errors import RequestError, RequestTooLargeError
from engine.kvcache.block_manager import BlockManager
from engine.kvcache.kv_cache import KVLayout, PagedKVCache
from engine.kvcache.prefix_cache import PrefixCache
from engine.kvcache.prefix_key import salt_base
from engine.kvcache.swap import HostSwap
from engine.request import Priority, Request, RequestState
from engine.sampling import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig, order_key

BS = 4
_ids = itertools.count()


def make(num_blocks=8, *, mode="recompute", watermark=0, prefix=False, **kw):
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, block_size=BS,
                      dtype=mx.float32)
    kv = PagedKVCache(layout, num_blocks)
    blocks = BlockManager(num_blocks, BS)
    base = salt_base(model_fingerprint="m", tokenizer_fingerprint="t", chat_template=None,
                     model_config={}, kv_format="float32", block_size=BS)
    cache = PrefixCache(kv, blocks, base, enabled=prefix)
    swap = HostSwap(kv, blocks, budget_bytes=1 << 20)
    cfg = SchedulerConfig(max_context=1024, watermark_blocks=watermark, preempt_mode=mode,
                          prefill_chunk=64, max_prefill_tokens=64, **kw)
    return Scheduler(blocks, cache, swap, cfg)


def request(sched: Scheduler, n_prompt: int, max_new: int = 4, *,
            priority=Priority.INTERACTIVE, first_token: int = 1) -> Request:
    rid = next(_ids)
    decoder = Decoder(SamplingParams(max_tokens=max_new), None, (), max_new)
    req = Request(rid, list(range(first_token, first_token + n_prompt)), decoder,
                  sched.prefix.new_sequence("local", 0), priority=priority,
                  arrival=float(rid))
    sched.add(req)
    return req


def computed(sched: Scheduler, req: Request) -> None:
    sched.prefix.on_computed(req.request_id, req.prefix, req.all_ids, req.num_computed,
                             len(req.prompt_ids))


def step(sched: Scheduler):
    """Plan one step and apply it as the engine would (tokens are all 7)."""
    plan = sched.schedule()
    for req, n, _ in plan.prefills:
        req.num_computed += n
        computed(sched, req)
    for req, _ in plan.decodes:
        req.num_computed += 1
        computed(sched, req)
        req.output_ids.append(7)
        if len(req.output_ids) >= req.max_new:
            sched.release(req)
            req.state = RequestState.FINISHED
    sched.blocks.check_invariants()
    return plan


def test_admission_by_free_blocks_then_waits():
    sched = make(num_blocks=6)
    a = request(sched, 11)  # 3 blocks for its prompt
    b = request(sched, 11)
    c = request(sched, 11)
    plan = step(sched)
    assert [x.request for x in plan.admitted] == [a, b]  # 6 blocks: the third waits
    assert sched.waiting == [c] and c.state is RequestState.WAITING
    assert sched.blocks.num_free_blocks == 0


def test_watermark_keeps_blocks_for_running_sequences():
    sched = make(num_blocks=8, watermark=2)
    a = request(sched, 11)  # 3 blocks, admitted into an idle pool
    step(sched)
    b = request(sched, 11)  # needs 3 of the 5 left; 2 must stay free while a runs
    step(sched)
    assert b.state is RequestState.RUNNING
    c = request(sched, 3)  # one block, but only 2 are free: the watermark holds it back
    step(sched)
    assert c.state is RequestState.WAITING and a.state is RequestState.RUNNING


def test_interactive_is_admitted_before_earlier_background():
    sched = make(num_blocks=3)
    bg = request(sched, 11, priority=Priority.BACKGROUND)
    fg = request(sched, 11, priority=Priority.INTERACTIVE)
    plan = step(sched)
    assert [x.request for x in plan.admitted] == [fg]
    assert sched.waiting == [bg]


def test_preempts_the_lowest_priority_most_recent_sequence():
    sched = make(num_blocks=6, max_running=3)
    a = request(sched, 8, max_new=20)  # 2 blocks; its second decode needs a third
    b = request(sched, 8, max_new=20, priority=Priority.BACKGROUND)
    c = request(sched, 8, max_new=20)
    plan = step(sched)  # all three prefill: 6 blocks in use
    assert len(plan.admitted) == 3 and sched.blocks.num_free_blocks == 0
    assert not step(sched).preempted  # the first decodes fit their last block
    plan = step(sched)  # the next decodes need blocks: the background one goes first
    assert plan.preempted[0] is b and b.state is RequestState.WAITING
    assert a.state is c.state is RequestState.RUNNING
    assert b.num_computed == 0 and b.stats.preemptions == 1
    assert b.request_id not in sched.blocks.block_tables
    # b's two blocks are the ones a and c grow into: none is lost, none left over
    assert [r for r, _ in plan.decodes] == [a, c]
    assert [len(sched.blocks.block_tables[r.request_id]) for r in (a, c)] == [3, 3]
    assert sched.blocks.num_free_blocks == 0


def test_swapped_sequences_resume_in_priority_order_before_new_ones():
    sched = make(num_blocks=6, mode="swap", max_running=3)
    a = request(sched, 8, max_new=4, priority=Priority.BACKGROUND)
    b = request(sched, 8, max_new=4, priority=Priority.BACKGROUND)
    c = request(sched, 8, max_new=12)  # 20 tokens: 5 of the 6 blocks at the end
    step(sched)
    step(sched)
    plan = step(sched)
    assert plan.preempted and all(r.state is RequestState.SWAPPED for r in plan.preempted)
    assert sched.swap.used_bytes > 0
    late = request(sched, 3, priority=Priority.BACKGROUND)
    for _ in range(200):
        if all(r.finished for r in (a, b, c, late)):
            break
        plan = step(sched)
        if any(x.request is late for x in plan.admitted):
            # a new request is admitted only when no swapped one of higher standing waits
            assert all(order_key(r) > order_key(late) for r in sched.swapped)
    assert all(r.finished for r in (a, b, c, late))
    assert not sched.swapped and sched.swap.used_bytes == 0
    assert sched.blocks.num_free_blocks == sched.blocks.num_blocks


def test_check_rejects_what_never_fits_and_truncates_what_overflows():
    sched = make(num_blocks=4)  # 16 tokens
    with pytest.raises(RequestTooLargeError, match="KV pool"):
        sched.check(16, 1)
    with pytest.raises(RequestError, match="empty"):
        sched.check(0, 1)
    assert sched.check(10, 4) == (4, None)
    max_new, notice = sched.check(10, 100)
    assert max_new == 6 and "reduced" in notice
    strict = make(num_blocks=4, overflow="reject")
    with pytest.raises(RequestTooLargeError):
        strict.check(10, 100)


def test_release_returns_every_block_and_leaves_every_queue():
    sched = make(num_blocks=8)
    reqs = [request(sched, 9) for _ in range(3)]
    step(sched)
    for r in reqs:
        held = len(sched.blocks.block_tables.get(r.request_id, ()))
        assert sched.release(r) == held
    assert not sched.has_work
    assert sched.blocks.num_free_blocks == sched.blocks.num_blocks


def test_a_failing_admission_fails_that_request_alone():
    sched = make(num_blocks=8, prefix=True)
    good = request(sched, 9)
    bad = request(sched, 9, first_token=50)
    real = sched.prefix.admit

    def admit(seq_id, seq, token_ids):
        if seq_id == bad.request_id:
            raise OSError("disk on fire")
        return real(seq_id, seq, token_ids)

    sched.prefix.admit = admit
    plan = step(sched)
    assert [r for r, _ in plan.failed] == [bad] and "disk on fire" in plan.failed[0][1]
    assert [x.request for x in plan.admitted] == [good]
    assert bad.request_id not in sched.blocks.block_tables and bad not in sched.waiting


def test_cached_prefix_blocks_are_shared_not_recomputed():
    sched = make(num_blocks=8, prefix=True)
    a = request(sched, 9, max_new=1)
    while not a.finished:
        step(sched)
    b = request(sched, 9, max_new=1)  # same tokens: two full blocks are cached
    plan = step(sched)
    assert plan.admitted[0].cached_tokens == 8 and plan.admitted[0].source == "memory"
    assert b.num_computed == 8
