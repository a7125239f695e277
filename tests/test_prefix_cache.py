"""Prefix cache in the engine: cold == warm (RAM) == warm (disk), tenants and versions apart."""

from __future__ import annotations

import inspect
import itertools
import os
import textwrap
import time

import pytest
from test_disk_quant import FORMATS, IDS, prefill, prefix_cache
from test_disk_writer import wait_until

from engine import Engine, EngineConfig, SamplingParams
from engine.kvcache.block_manager import BlockManager


def run(engine, ids, n=16, **kw):
    r = engine.generate_text(ids, SamplingParams(max_tokens=n), **kw)
    return r.tokens, r.stats


def doc_prompt(engine, question: str) -> list[int]:
    doc = inspect.getsource(textwrap)[:3000]
    return engine.encode_prompt(f"{question}\n\n{doc}", system="You answer questions on code.")


def disk_engine(model, tmp_path, **kw) -> Engine:
    return Engine(model, EngineConfig(kv_budget_bytes=128 << 20, disk_cache=True,
                                      disk_cache_dir=str(tmp_path / "prefix"), **kw))


@pytest.mark.slow
def test_cold_warm_ram_warm_disk_identical(quick_model, tmp_path):
    # the default model as load_model() gives it here (Q4/Q8 on the CPU extension where it
    # builds): the float32 path's warm runs are checked in tests/test_engine_parity.py (RAM,
    # against mlx-lm) and tests/test_kv_quant.py (a restart served from disk)
    cold_engine = Engine(quick_model, EngineConfig(kv_budget_bytes=128 << 20,
                                                   prefix_cache=False))
    ids = doc_prompt(cold_engine, "What does this module do?")
    assert len(ids) > 600
    cold, s0 = run(cold_engine, ids)
    assert s0.cached_tokens == 0 and s0.cache_source == "none"

    engine = disk_engine(quick_model, tmp_path)
    first, s1 = run(engine, ids)
    warm, s2 = run(engine, ids)
    assert first == cold and warm == cold
    assert s1.cache_source == "none"
    assert s2.cache_source == "memory" and s2.cached_tokens == (len(ids) - 1) // 16 * 16
    m = engine.metrics()
    assert m.blocks_cached > 0 and 0 < m.hit_rate < 1
    engine.shutdown()  # flushes the background writer
    assert m.disk_entries > 0 or engine.prefix.store.stats().entries > 0

    restarted = disk_engine(quick_model, tmp_path)  # a new engine: nothing in RAM
    from_disk, s3 = run(restarted, ids)
    assert from_disk == cold
    assert s3.cache_source == "disk" and s3.cached_tokens == s2.cached_tokens
    assert restarted.metrics().disk_hits == s3.cached_tokens // 16
    restarted.shutdown()


def test_tenants_never_share_blocks(tiny_model, tmp_path):
    engine = disk_engine(tiny_model, tmp_path, block_size=4)
    ids = list(range(100, 160))
    run(engine, ids, tenant="alice")
    _, again = run(engine, ids, tenant="alice")
    assert again.cached_tokens == 56
    _, bob = run(engine, ids, tenant="bob")
    assert bob.cached_tokens == 0 and bob.cache_source == "none"
    # running side by side: not one block in common
    ha = engine.submit(ids, SamplingParams(max_tokens=4), tenant="alice")
    hb = engine.submit(ids, SamplingParams(max_tokens=4), tenant="carol")
    engine.step()
    ta = set(engine.blocks.block_tables[ha.request_id])
    tb = set(engine.blocks.block_tables[hb.request_id])
    assert ta and tb and not ta & tb and engine.blocks.num_shared_blocks == 0
    list(ha), list(hb)
    engine.shutdown()
    # on disk: a fresh engine, another tenant, the same text -> no disk hit
    fresh = disk_engine(tiny_model, tmp_path, block_size=4)
    _, dave = run(fresh, ids, tenant="dave")
    assert dave.cache_source == "none" and fresh.metrics().disk_hits == 0
    _, alice = run(fresh, ids, tenant="alice")
    assert alice.cache_source == "disk"
    fresh.shutdown()


def test_disk_writes_wait_until_no_sequence_holds_the_pool(tiny_model, tmp_path):
    # a write took CPU from the decode beside it (2 cores): blocks persist once it is idle
    engine = disk_engine(tiny_model, tmp_path, block_size=4)
    store = engine.prefix.store
    h = engine.submit(list(range(400, 440)), SamplingParams(max_tokens=100, ignore_eos=True))
    events = iter(h)
    while next(events).token is None:  # the prompt is in: its 10 blocks are queued
        pass
    time.sleep(0.3)
    s = store.stats()
    assert (s.writes, s.pending_writes) == (0, 10)  # the sequence still holds its blocks
    assert engine.cancel(h.request_id) and not engine.blocks.block_tables
    assert wait_until(lambda: store.stats().writes == 10)  # no flush: idle is enough
    engine.shutdown()


def test_permission_version_bump_makes_old_blocks_unreachable(tiny_model, tmp_path):
    engine = disk_engine(tiny_model, tmp_path, block_size=4)
    ids = list(range(200, 240))
    run(engine, ids, tenant="t", permission_version=1)
    _, same = run(engine, ids, tenant="t", permission_version=1)
    _, bumped = run(engine, ids, tenant="t", permission_version=2)
    assert same.cached_tokens > 0 and bumped.cached_tokens == 0
    engine.shutdown()
    fresh = disk_engine(tiny_model, tmp_path, block_size=4)
    _, s = run(fresh, ids, tenant="t", permission_version=3)
    assert s.cache_source == "none"
    fresh.shutdown()


def test_corrupt_disk_entries_are_misses_and_output_is_unchanged(tiny_model, tmp_path):
    engine = disk_engine(tiny_model, tmp_path, block_size=4)
    ids = list(range(300, 340))
    ref, _ = run(engine, ids)
    engine.shutdown()
    files = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "prefix") for f in fs]
    assert len(files) == 10  # every full prompt block (the last fills at the first decode)
    for f in files:  # flip one payload byte in every entry
        with open(f, "r+b") as fh:
            fh.seek(os.path.getsize(f) - 100)
            b = fh.read(1)
            fh.seek(-1, 1)
            fh.write(bytes([b[0] ^ 0xFF]))
    fresh = disk_engine(tiny_model, tmp_path, block_size=4)
    tokens, s = run(fresh, ids)
    assert tokens == ref and s.cache_source == "none"
    st = fresh.prefix.store.stats()
    assert st.misses_by_reason.get("corrupt") == 1  # the first block; the chain stops there
    fresh.shutdown()


def test_lru_eviction_under_pressure_is_counted(tiny_model):
    engine = Engine(tiny_model, EngineConfig(block_size=4, kv_budget_bytes=16 * 2048))
    first = list(range(400, 420))
    run(engine, first, n=4)
    assert engine.metrics().blocks_cached == 5  # 23 computed tokens: 5 full blocks
    for k in range(3):  # other prompts push the first one's blocks out, oldest first
        run(engine, list(range(500 + 40 * k, 530 + 40 * k)), n=4)
    m = engine.metrics()
    assert m.evictions > 0 and m.blocks_free == m.blocks_total
    _, s = run(engine, first, n=4)
    assert s.cached_tokens == 0
    engine.blocks.check_invariants()


def test_chat_history_reuses_the_previous_turn(default_engine):
    e = default_engine
    ids1 = e.encode_prompt("Name a color.")
    text = e.generate_text(ids1, SamplingParams(max_tokens=8)).text
    history = [{"role": "user", "content": "Name a color."},
               {"role": "assistant", "content": text}]
    ids2 = e.encode_prompt("And another one?", history=history)
    assert ids2[: len(ids1)] == ids1
    _, s = run(e, ids2, n=4)
    assert s.cache_source == "memory" and s.cached_tokens >= len(ids1) // 16 * 16


@pytest.mark.parametrize("writer,reader", list(itertools.permutations(FORMATS, 2)))
def test_ram_blocks_of_another_kv_format_are_never_served(writer, reader):
    # Two pools over one block table space: only the key can keep their blocks apart.
    blocks = BlockManager(16, 4)
    first = prefix_cache(writer, None, blocks)
    prefill(first)
    blocks.free(0)  # its 3 full blocks stay cached, evictable
    other = prefix_cache(reader, None, blocks)
    assert other.ram_hits(other.new_sequence("local", 0), IDS) == []
    same = prefix_cache(writer, None, blocks)  # the control: its own format hits
    assert len(same.ram_hits(same.new_sequence("local", 0), IDS)) == 3
