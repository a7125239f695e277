"""Continuous batching on the real default model: batched == alone, preemption, every ending.

The model is `quick_model`: the default model as `load_model()` gives it on this machine
(Q4/Q8 weights on the CPU extension where it builds, else float32), so each step costs a
fraction of the float32 path's. The float32 path's batching is checked end to end here too
(`test_ragged_batch_equals_alone`) and at model level in tests/test_model_runner.py.
"""

from __future__ import annotations

import threading

import pytest

from engine import Engine, EngineConfig, SamplingParams
from engine.errors import EngineStoppedError, RequestTooLargeError
from engine.request import Priority, RequestState

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a KV cache is.",
    "List three prime numbers greater than 100.",
    "Why is the sky blue?",
    "Give me a recipe for pancakes.",
]
GEN = 40  # outputs outgrow their prompts: growth, not admission, fills the pool


def params(n=GEN):
    return SamplingParams(max_tokens=n, ignore_eos=True)


def collect(handle):
    tokens, final = [], None
    for event in handle:
        if event.token is not None:
            tokens.append(event.token)
        final = event
    return tokens, final


@pytest.fixture(scope="module")
def alone(quick_model):
    """Greedy tokens of each prompt run alone on a roomy pool, a step at a time (the
    reference: pipelining is the default where the extension's pick can chain steps)."""
    engine = Engine(quick_model, EngineConfig(kv_budget_bytes=64 << 20, pipeline=False))
    ids = [engine.encode_prompt(p) for p in PROMPTS]
    return ids, [engine.generate_text(i, params()).tokens for i in ids]


def pool_of(model, blocks: int, **kw) -> Engine:
    probe = Engine(model, EngineConfig(kv_budget_bytes=1 << 20))
    return Engine(model, EngineConfig(
        kv_budget_bytes=blocks * probe.layout.bytes_per_block, **kw))


def test_batched_equals_alone(quick_model, alone):
    ids, ref = alone
    # pipelined (launched ahead) against the unpipelined reference
    engine = Engine(quick_model, EngineConfig(kv_budget_bytes=64 << 20, max_running=8,
                                              pipeline=True))
    assert engine.executor.pipeline
    handles = [engine.submit(i, params()) for i in ids]
    outs = [collect(h)[0] for h in handles]
    assert outs == ref
    m = engine.metrics()
    # all six decoded together: far fewer steps than tokens
    assert m.steps < len(ids) * GEN / 2
    assert m.blocks_used == 0 and m.finished == {"length": len(ids)}


def test_a_declined_pick_rebuilds_the_chained_step(quick_model, alone, monkeypatch):
    """A chained step feeds the previous step's picks unread. Where the pick declines a row
    (-1: a near tie it cannot settle), the next step was built on a wrong token: it is built
    again over the pool as it was, and the tokens stay the reference's."""
    import mlx.core as mx

    from engine import greedy
    from engine.model.cpu_ext import build

    if not build.available():
        pytest.skip("the fast pick is the CPU extension's")
    ids, ref = alone
    engine = Engine(quick_model, EngineConfig(kv_budget_bytes=64 << 20, max_running=8))
    assert engine.executor.pipeline and engine.executor.fast_chain  # the CPU default here
    calls, lazy = [0], greedy.lazy

    def declining(logits, *, fast):  # every third launched step declines all of its rows
        calls[0] += 1
        picked = lazy(logits, fast=fast)
        return mx.full(picked.shape, -1, mx.int32) if calls[0] % 3 == 0 else picked

    monkeypatch.setattr(greedy, "lazy", declining)
    handles = [engine.submit(i, params()) for i in ids[:3]]
    assert [collect(h)[0] for h in handles] == ref[:3]
    m = engine.metrics()
    assert m.rebuilt_steps > 5 and m.blocks_used == 0


def test_the_residual_formats_chain_and_rebuild_like_the_others(quick_model, monkeypatch):
    """Their block quantization writes new arrays through the one-op writer and their
    snapshot holds the residual rows' bookkeeping, so chained steps feed the extension's
    pick, and one whose pick declined (every other step here, block-filling steps among
    them) is built again from the pool as it was: the tokens of unchained decoding."""
    import mlx.core as mx

    from engine import greedy
    from engine.model.cpu_ext import build

    if not build.available():
        pytest.skip("the CPU default is the extension's")
    kivi = dict(kv_budget_bytes=64 << 20, kv_bits=4, kv_residual=True, kv_key_channel=True)
    engine = Engine(quick_model, EngineConfig(max_running=8, **kivi))
    ex = engine.executor
    assert engine.kv.snapshot() is not None and ex.fast_chain and ex.chain_rows is None
    ids = [engine.encode_prompt(p) for p in PROMPTS[:2]]
    plain = Engine(quick_model, EngineConfig(pipeline=False, **kivi))
    want = [plain.generate_text(i, params(40)).tokens for i in ids]
    undone, restore, lazy, calls = [], engine.kv.restore, greedy.lazy, [0]

    def spy(snap):  # whether the step given up had filled (and quantized) a block
        undone.append(bool(engine.kv._filled))
        restore(snap)

    def declining(logits, *, fast):
        calls[0] += 1
        picked = lazy(logits, fast=fast)
        return mx.full(picked.shape, -1, mx.int32) if calls[0] % 2 == 0 else picked

    monkeypatch.setattr(engine.kv, "restore", spy)
    monkeypatch.setattr(greedy, "lazy", declining)
    assert [engine.generate_text(i, params(40)).tokens for i in ids] == want  # chained alone
    handles = [engine.submit(i, params(40)) for i in ids]  # two rows chained
    assert [collect(h)[0] for h in handles] == want
    m = engine.metrics()
    assert any(undone) and m.rebuilt_steps > 10 and m.blocks_used == 0


def test_a_pipelined_decode_writes_the_pool_in_place(quick_model):
    """A step launched while the previous one still runs finds the pool held by that step's
    queued tasks: its writes copied every layer's pool (+27 MB of peak here) until launching
    waited for the previous step (then one layer's pool is 4.5 MB, the step ~1 MB)."""
    import mlx.core as mx

    engine = Engine(quick_model, EngineConfig(kv_budget_bytes=256 << 20, pipeline=True))
    ids = engine.encode_prompt("Tell me about cats.")
    engine.generate_text(ids, params(4))
    mx.synchronize()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    assert len(engine.generate_text(ids, params(24)).tokens) == 24
    layer_pool = engine.kv.keys[0].nbytes
    assert mx.get_peak_memory() - base < layer_pool / 2
    assert engine.metrics().blocks_used == 0


def test_a_prefill_returns_its_scratch_instead_of_caching_it(quick_model):
    """On the CPU a prefill step's freed scratch leaves MLX's buffer cache (the cache grew
    beside the live arrays: ~30 MB of a 1B file's peak RSS); the limit comes back after."""
    import mlx.core as mx

    from engine.model.backend import backend

    if backend() != "cpu":
        pytest.skip("the GPU backends keep their cache")
    engine = Engine(quick_model, EngineConfig(kv_budget_bytes=64 << 20))
    ids = engine.encode_prompt(" ".join(PROMPTS) * 12)
    assert len(ids) > 400  # several layers' chunk-sized scratch
    limit = 3 << 30
    previous = mx.set_cache_limit(limit)
    try:
        mx.clear_cache()
        assert engine.generate_text(ids, params(1)).tokens
        assert mx.get_cache_memory() < 3 << 20  # 7.7 MB stayed cached before
        assert mx.set_cache_limit(limit) == limit
    finally:
        mx.set_cache_limit(previous)


_FAULTS = """
import resource, sys
from engine import Engine, EngineConfig, SamplingParams, load_model
from engine.model import memory
if sys.argv[1] == "kept":
    memory.PREFILL_MMAP_THRESHOLD = memory.MMAP_THRESHOLD
eng = Engine(load_model(), EngineConfig(kv_budget_bytes=64 << 20, prefix_cache=False,
                                        disk_cache=False))
out = []
for i in range(8):  # each prompt its own: nothing cached
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    ids = [1000 + i + j for j in range(450)]
    eng.generate_text(ids, SamplingParams(max_tokens=1, temperature=0.0))
    out.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
eng.shutdown()
print(" ".join(map(str, out)))
"""


@pytest.mark.subprocess  # a fresh heap each: what an earlier test grew would serve both
def test_a_prefill_reuses_freed_scratch_instead_of_fresh_pages():
    """A prefill step carves its layers' scratch from what the layers before it freed
    (glibc's mmap threshold raised meanwhile): once the heap has grown, a 450-token prefill
    of the default model takes ~9k page faults (a 1B file's 512 tokens: none), ~33k with
    the 1 MiB threshold kept (the 1B file's: ~105k)."""
    import subprocess
    import sys

    from engine.model.backend import backend

    if backend() != "cpu":
        pytest.skip("the CPU backend's scratch")

    def faults(mode: str) -> int:
        run = subprocess.run([sys.executable, "-c", _FAULTS, mode], capture_output=True,
                             text=True, timeout=300, check=True)
        return min(int(n) for n in run.stdout.split()[-4:])  # the heap grown

    raised, kept = faults("raised"), faults("kept")
    assert kept > 2.5 * raised, (raised, kept)  # measured ~9.0k against ~33k


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_three_times_oversubscribed_pool(quick_model, alone, mode):
    ids, ref = alone
    need = sum(-(-(len(i) + GEN) // 16) for i in ids)
    engine = pool_of(quick_model, need // 3, max_running=6, preempt_mode=mode,
                   pipeline=mode == "recompute")  # both step paths under preemption
    handles = [engine.submit(i, params()) for i in ids]
    outs = [collect(h)[0] for h in handles]
    m = engine.metrics()
    assert m.preemptions > 0, "no pressure"
    assert outs == ref  # preempted requests resume with identical greedy output
    assert m.blocks_free == m.blocks_total
    assert m.peak_bytes <= m.budget_bytes


def test_interactive_preempts_background(quick_model, alone):
    ids, ref = alone
    engine = pool_of(quick_model, 12, max_running=8)
    bg = [engine.submit(i, params(), priority=Priority.BACKGROUND) for i in ids[:3]]
    for _ in range(4):
        engine.step()  # the background requests fill the pool
    fg = engine.submit(ids[3], params(), priority=Priority.INTERACTIVE)
    tokens, final = collect(fg)
    assert tokens == ref[3]
    assert any(engine.request_state(h.request_id) is not RequestState.FINISHED for h in bg), \
        "interactive did not go first"
    assert [collect(h)[0] for h in bg] == ref[:3]
    assert engine.metrics().preemptions > 0


def test_never_fits_is_rejected_at_once(quick_model):
    engine = pool_of(quick_model, 4)  # 64 tokens
    with pytest.raises(RequestTooLargeError, match="KV pool"):
        engine.submit(list(range(100, 180)), params())
    strict = pool_of(quick_model, 4, overflow="reject")
    with pytest.raises(RequestTooLargeError, match="exceed"):
        strict.submit(list(range(100, 140)), params(40))
    # the default policy admits it with a smaller output, and says so
    h = engine.submit(list(range(100, 140)), params(40))
    assert h.notice == "max_tokens reduced from 40 to 24 to fit" and h.max_tokens == 24
    tokens, final = collect(h)
    assert len(tokens) == 24 and final.finish_reason == "length"
    assert engine.metrics().rejections == 1 and strict.metrics().rejections == 1


def test_cancel_mid_prefill_releases_within_a_step(quick_model):
    engine = Engine(quick_model, EngineConfig(kv_budget_bytes=64 << 20, prefill_chunk=64))
    ids = engine.encode_prompt("word " * 600)
    it = iter(engine.submit(ids, params()))
    assert next(it).prefill == (0, len(ids))  # at admission: a progress bar shows at once
    first = next(it)
    assert first.prefill == (64, len(ids)) and first.token is None
    steps = engine.metrics().steps
    assert engine.blocks.num_used_blocks == 4
    engine.cancel(first.request_id)
    final = next(it)
    assert final.finish_reason == "cancelled" and final.stats.blocks_released == 4
    assert engine.metrics().steps == steps  # no further step was needed
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert final.stats.release_latency_ms < 1000


def test_timeout_error_and_shutdown_release_blocks(quick_model, alone):
    ids, ref = alone
    engine = Engine(quick_model, EngineConfig(kv_budget_bytes=64 << 20))
    doomed = engine.submit(ids[0], params())

    def fault(req, phase):
        if req.request_id == doomed.request_id and phase == "token" and req.output_ids:
            raise ValueError("boom")

    engine.executor.fault_hook = fault
    late = engine.submit(ids[1], params(), timeout_s=0.0)
    fine = engine.submit(ids[2], params())
    final = collect(doomed)[1]
    assert final.finish_reason == "error" and "ValueError: boom" in final.error
    assert collect(late)[1].finish_reason == "timeout"
    assert collect(fine)[0] == ref[2]  # the error stayed with its own request
    engine.executor.fault_hook = None
    pending = [engine.submit(i, params()) for i in ids[3:]]
    engine.step()
    engine.step()
    assert engine.blocks.num_used_blocks > 0
    engine.shutdown()
    assert [collect(h)[1].finish_reason for h in pending] == ["shutdown"] * 3
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    with pytest.raises(EngineStoppedError):
        engine.submit(ids[0], params())


def test_engine_thread_serves_concurrent_consumers(quick_model, alone):
    ids, ref = alone
    engine = Engine(quick_model, EngineConfig(kv_budget_bytes=64 << 20))
    engine.start()
    results: dict[int, list] = {}

    def consume(k):
        results[k] = collect(engine.submit(ids[k], params()))[0]

    threads = [threading.Thread(target=consume, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    # a fourth consumer walks away after two tokens: its request is cancelled
    gone = engine.submit(ids[3], params())
    # progress events (prefill chunks) come first: leave after two tokens
    tokens = 0
    for event in gone:
        tokens += event.token is not None
        if tokens == 2:
            break
    for t in threads:
        t.join(timeout=120)
    assert [results[k] for k in range(3)] == ref[:3]
    m = engine.metrics()
    assert m.finished.get("cancelled") == 1
    lat = m.latency
    assert lat["ttft_s"].count == 4 and lat["itl_s"].count > 0
    assert lat["itl_s"].p50 <= lat["itl_s"].p95 <= lat["itl_s"].p99
    engine.shutdown()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    # nothing in use: every block is free or kept as evictable prefix cache
    assert set(engine.block_map()) <= {".", "c"}
    assert engine.block_map().count("c") == engine.blocks.num_cached_blocks > 0


def test_a_failing_step_fails_its_requests_and_the_engine_goes_on(tiny_model):
    engine = Engine(tiny_model, EngineConfig(block_size=4, kv_budget_bytes=1 << 20))
    engine.start()
    real = engine.scheduler.schedule
    calls = []

    def broken():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("scheduler bug")
        return real()

    engine.scheduler.schedule = broken
    tokens, final = collect(engine.submit(list(range(100, 120)), params(4)))
    assert final.finish_reason == "error" and "scheduler bug" in final.error
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    tokens, final = collect(engine.submit(list(range(100, 120)), params(4)))
    assert final.finish_reason == "length" and len(tokens) == 4
    engine.shutdown()


def test_ragged_batch_equals_alone(default_model):
    """A long chat among short ones: attention runs per length group, tokens unchanged.
    On the float32 path: MLX's own matmuls over one row alone and over a batch of rows."""
    lone = Engine(default_model, EngineConfig(kv_budget_bytes=64 << 20))
    ids = [lone.encode_prompt(p) for p in PROMPTS[:3]]
    ref = [lone.generate_text(i, params(16)).tokens for i in ids]
    engine = Engine(default_model, EngineConfig(kv_budget_bytes=64 << 20, max_running=8))
    long_ids = engine.encode_prompt("Tell me a long story about a cat and a dog. " * 40)
    long_ref = engine.generate_text(long_ids, params(16)).tokens
    handles = [engine.submit(i, params(16)) for i in ids]
    handles.append(engine.submit(long_ids, params(16)))
    outs = [collect(h)[0] for h in handles]
    assert outs == ref + [long_ref]
