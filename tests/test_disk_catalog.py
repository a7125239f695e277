"""The store's record of its entries: the byte budget in LRU order, TTL sweeps, purges."""

from __future__ import annotations

import dataclasses

import pytest
from disk_blocks import SALT, T0, Clock, all_files, get, make_block, put

from engine.kvcache.disk.store import DiskPrefixStore


@pytest.fixture
def clock():
    return Clock()


def test_budget_enforced_at_start_up_in_lru_order(tmp_path, clock):
    root = tmp_path / "prefix"
    blocks = [make_block(20 + i) for i in range(5)]
    with DiskPrefixStore(root, clock=clock) as s:
        for b in blocks:
            clock.t += 1
            put(s, b)
        clock.t += 1
        assert get(s, blocks[0]) is not None  # now the most recently used
        size = s.stats().bytes // 5
    s2 = DiskPrefixStore(root, budget_bytes=2 * size, clock=clock)
    assert {e.hash for e in s2.entries()} == {blocks[0].hash.hex(), blocks[4].hash.hex()}
    assert s2.stats().evictions == 3
    assert len(all_files(root)) == 2


def test_budget_enforced_while_running(tmp_path, clock):
    blocks = [make_block(30 + i) for i in range(5)]
    probe = DiskPrefixStore(tmp_path / "probe", clock=clock)
    put(probe, blocks[0])
    size = probe.stats().bytes  # every block here has the same size
    store = DiskPrefixStore(tmp_path / "p", budget_bytes=3 * size + size // 2, clock=clock)
    for b in blocks:
        clock.t += 1
        assert put(store, b)
    assert store.stats().bytes == 3 * size
    assert [e.hash for e in store.entries()] == [b.hash.hex() for b in blocks[::-1][:3]]
    assert store.stats().evictions == 2 and len(all_files(store.root)) == 3
    huge = make_block(40, dim=8 * 1024)
    assert not put(store, huge)  # alone larger than the budget


def test_ttl_sweep_and_tenant_ttl(tmp_path, clock):
    store = DiskPrefixStore(tmp_path / "p", tenant_ttl_s={"brief": 10}, clock=clock)
    short = make_block(50, dataclasses.replace(SALT, tenant="brief"))
    default = make_block(51)
    explicit = make_block(52)
    put(store, short)
    put(store, default)
    put(store, explicit, ttl_s=100)
    assert not put(store, make_block(53), ttl_s=0)
    by_hash = {e.hash: e for e in store.entries()}
    assert by_hash[short.hash.hex()].expires == T0 + 10
    assert by_hash[default.hash.hex()].expires == T0 + 24 * 3600
    clock.t += 50
    assert store.sweep() == 1
    clock.t += 50
    assert store.sweep() == 1
    assert [e.hash for e in store.entries()] == [default.hash.hex()]
    assert store.stats().expired_removed == 2
    # and expiry is enforced at start-up too
    clock.t += 24 * 3600
    assert DiskPrefixStore(store.root, clock=clock).stats().entries == 0
    assert all_files(store.root) == []


def test_purge(tmp_path, clock):
    store = DiskPrefixStore(tmp_path / "p", clock=clock)
    a1 = make_block(60, dataclasses.replace(SALT, tenant="a"))
    a2 = make_block(61, dataclasses.replace(SALT, tenant="a", model_fingerprint="sha256:zzz"))
    b1 = make_block(62, dataclasses.replace(SALT, tenant="b"))
    loc = make_block(63)
    for blk in (a1, a2, b1):
        put(store, blk)
    put(store, loc, ttl_s=5)
    with pytest.raises(ValueError):
        store.purge()
    assert store.purge(tenant="a") == 2
    assert {e.tenant for e in store.entries()} == {"b", "local"}
    assert store.purge(model="sha256:zzz") == 0
    assert store.purge(expired_only=True) == 0
    clock.t += 10
    assert store.purge(expired_only=True) == 1
    put(store, a2)
    assert store.purge(model="sha256:z") == 1  # a prefix of the fingerprint
    assert store.purge(all=True) == 1
    assert store.stats().entries == 0 and all_files(store.root) == []
