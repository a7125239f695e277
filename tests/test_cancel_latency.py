"""Cancel during a long prefill: the forward stops between layer groups, blocks come back.

Reports the release latency (cancel() -> blocks back in the pool) P50/P95 over cancels
that land at arbitrary points inside 512-token prefill chunks. A figure, not a timed
assertion: what is asserted is that forwards were interrupted and nothing leaked.
"""

from __future__ import annotations

import random
import time

import pytest

from engine import Engine, EngineConfig, SamplingParams
from engine.metrics import Percentiles

SAMPLES = 8


@pytest.fixture(scope="module")
def long_prompts(default_model):
    tok = default_model.tokenizer
    words = ["harbor", "lantern", "copper", "meadow", "signal", "orchard", "granite",
             "violet", "tunnel", "ember"]
    rng = random.Random(7)
    # distinct texts: no request can reuse another's blocks
    return [tok.encode(" ".join(rng.choice(words) for _ in range(1400))) for _ in range(SAMPLES)]


def test_cancel_mid_prefill_lands_between_layer_groups(default_model, long_prompts, capsys):
    eng = Engine(default_model, EngineConfig(kv_budget_bytes=128 << 20, prefix_cache=False))
    eng.start()
    rng = random.Random(3)
    latencies, walls = [], []
    try:
        for ids in long_prompts:
            handle = eng.submit(ids, SamplingParams(max_tokens=4))
            events = iter(handle)  # one iterator: dropping one cancels the request
            first = next(events)
            assert first.prefill == (0, len(ids))  # the bar can show before any chunk ran
            time.sleep(rng.uniform(0.05, 1.0))  # anywhere inside the first chunks
            t = time.perf_counter()
            assert eng.cancel(handle.request_id)
            final = [e for e in events][-1]
            walls.append((time.perf_counter() - t) * 1000)
            assert final.finish_reason == "cancelled"
            latencies.append(final.stats.release_latency_ms)
        m = eng.metrics()
    finally:
        eng.shutdown()
    assert m.blocks_free == m.blocks_total  # every cancelled prefill gave its blocks back
    assert m.interrupted_forwards >= 1  # cancels stopped forwards mid-chunk
    p = Percentiles.of(latencies)
    w = Percentiles.of(walls)
    with capsys.disabled():
        print(f"\n[cancel mid-prefill] release latency over {p.count} cancels: "
              f"P50 {p.p50:.0f} ms, P95 {p.p95:.0f} ms, max {max(latencies):.0f} ms "
              f"(cancel -> final event P95 {w.p95:.0f} ms; "
              f"{m.interrupted_forwards} forwards interrupted)")
