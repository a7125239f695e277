"""Chaos: 1,000 randomized requests on a tiny pool; every request ends defined, 0 blocks leak.

Cancels land at random points of prefill and decode, some requests time out,
some hit an injected error inside their own step, some consumers just go
away. After every step the pool's refcounts must match the block tables;
at the end every block is free again.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

import pytest

from engine import Engine, EngineConfig, SamplingParams
from engine.errors import RequestTooLargeError
from engine.request import Priority

ACTIONS = ["run"] * 5 + ["cancel", "cancel", "vanish", "error", "timeout"]
ENDINGS = {"stop", "length", "cancelled", "timeout", "error"}


class InjectedError(RuntimeError):
    pass


@dataclass
class Track:
    handle: object
    action: str
    trigger: int  # act after this many events
    phase: str  # where an injected error strikes
    seen: int = 0
    consumer: object = None  # the generator of a consumer that will vanish


def drive(engine: Engine, n_requests: int, seed: int) -> tuple[Counter, dict]:
    rng = random.Random(seed)
    armed: dict[int, str] = {}

    def fault(req, phase):
        if armed.get(req.request_id) == phase:
            raise InjectedError(f"injected into {phase}")

    engine.executor.fault_hook = fault
    freed: dict[int, int] = {}  # what the last BlockManager.free of each sequence returned
    real_free = engine.blocks.free

    def spy_free(seq_id):
        freed[seq_id] = real_free(seq_id)
        return freed[seq_id]

    engine.blocks.free = spy_free
    live: dict[int, Track] = {}
    outcomes: Counter = Counter()
    by_action: dict[str, Counter] = {}
    submitted = 0
    vocab = engine.loaded.config["vocab_size"]
    while submitted < n_requests or live:
        while submitted < n_requests and len(live) < 24:
            submitted += 1
            action = rng.choice(ACTIONS)
            n = rng.choice([1, 2, 5, 12, 30, 60, 200])
            prompt = [rng.randrange(10, vocab) for _ in range(n)]
            params = SamplingParams(max_tokens=rng.randint(1, 8), ignore_eos=rng.random() < 0.5)
            timeout = rng.uniform(0.0, 0.03) if action == "timeout" else None
            try:
                h = engine.submit(prompt, params, priority=rng.choice(list(Priority)),
                                  timeout_s=timeout)
            except RequestTooLargeError:
                outcomes["rejected"] += 1
                continue
            t = Track(h, action, rng.randint(0, 6), rng.choice(["prefill", "decode", "token"]))
            if action == "vanish":
                t.consumer = iter(h)
            live[h.request_id] = t
        engine.step()
        engine.blocks.check_invariants()
        for rid, t in list(live.items()):
            while t.handle.ready:
                # a consumer's generator reads only what is ready: it never steps the engine
                event = next(t.consumer) if t.consumer is not None else t.handle.poll()
                t.seen += 1
                if event.finish_reason is not None:
                    assert event.finish_reason in ENDINGS, event
                    # the release dropped exactly the references the block manager held
                    assert event.stats.blocks_released == freed.pop(rid), event
                    assert rid not in engine.blocks.block_tables
                    outcomes[event.finish_reason] += 1
                    by_action.setdefault(t.action, Counter())[event.finish_reason] += 1
                    del live[rid]
                    break
            if rid not in live or t.seen < t.trigger:
                continue
            if t.action == "cancel":
                engine.cancel(rid)
            elif t.action == "error":
                armed[rid] = t.phase
            elif t.action == "vanish" and t.consumer is not None:
                t.consumer = None  # the consumer goes away: the generator is collected
                # its finally cancels the request; the final event is then ours to read
    return outcomes, by_action


@pytest.mark.parametrize("mode,n", [("recompute", 1000), ("swap", 300)])
def test_chaos_no_block_leaks(tiny_model, mode, n):
    # 24 blocks of 4 tokens: a 200-token prompt alone fills half the pool
    engine = Engine(tiny_model, EngineConfig(
        block_size=4, kv_budget_bytes=24 * 4 * 2 * 2 * 2 * 16 * 4, prefill_chunk=16,
        max_running=8, preempt_mode=mode, swap_budget_bytes=1 << 20,
        pipeline=mode == "recompute"))  # launched-ahead decodes (GPU's default) and plain ones
    assert engine.blocks.num_blocks == 24
    outcomes, by_action = drive(engine, n, seed=7 if mode == "recompute" else 11)

    assert sum(outcomes.values()) == n  # every request ended, one way or another
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks  # free + cached == total
    assert not engine.blocks.block_tables and engine.swap.used_bytes == 0
    assert not engine.scheduler.has_work and engine.live_requests() == 0
    engine.blocks.check_invariants()
    m = engine.metrics()
    assert m.preemptions > 0, "the pool was never under pressure"
    assert m.blocks_used == 0 and m.active_sequences == 0
    assert m.rejections == outcomes["rejected"]
    # requests left alone end normally; errors strike only the requests they were aimed at
    assert set(by_action["run"]) <= {"stop", "length"}
    assert set(by_action["vanish"]) <= {"stop", "length", "cancelled"}
    assert by_action["vanish"]["cancelled"] > 0
    assert by_action["cancel"]["cancelled"] > 0
    assert by_action["error"]["error"] > 0 and by_action["timeout"]["timeout"] > 0
    assert sum(c["error"] for a, c in by_action.items() if a != "error") == 0
