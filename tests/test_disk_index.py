"""Per-tenant TTLs saved with the store, and expired entries counted where they are purged."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import stat

import pytest
from disk_blocks import SALT, T0, Clock, all_files, entry_path, get, make_block, put, same

from engine.kvcache.disk.store import TTL_FILE, DiskPrefixStore

ALICE = dataclasses.replace(SALT, tenant="alice")
BOB = dataclasses.replace(SALT, tenant="bob")


@pytest.fixture
def clock():
    return Clock()


def test_a_tenant_ttl_is_saved_for_every_store_on_the_directory(tmp_path, clock):
    root = tmp_path / "prefix"
    s = DiskPrefixStore(root, clock=clock)
    a1, b1 = make_block(1, ALICE), make_block(2, BOB)
    put(s, a1)
    put(s, b1)
    clock.t += 100
    assert s.set_tenant_ttl("alice", 60) == 1  # a1 is older than the new TTL: gone now
    assert not entry_path(s, a1).exists() and same(get(s, b1), b1.arrays)
    assert stat.S_IMODE((root / TTL_FILE).stat().st_mode) == 0o600
    a2 = make_block(3, ALICE)
    put(s, a2)
    later = DiskPrefixStore(root, clock=clock)  # e.g. the next engine
    assert later.ttls.by_tenant == {"alice": 60}
    a3 = make_block(4, ALICE)
    put(later, a3)
    assert {e.hash: e.expires for e in later.entries() if e.tenant == "alice"} == {
        a2.hash.hex(): T0 + 160, a3.hash.hex(): T0 + 160}
    assert later.set_tenant_ttl("alice", None) == 0  # back to the default
    assert json.loads((root / TTL_FILE).read_text()) == {}
    assert DiskPrefixStore(root, clock=clock).ttls.by_tenant == {}


def test_a_running_store_takes_a_new_ttl_at_its_next_sweep(tmp_path, clock):
    root = tmp_path / "prefix"
    engine_store = DiskPrefixStore(root, clock=clock)
    a = make_block(5, ALICE)
    put(engine_store, a)
    clock.t += 30
    DiskPrefixStore(root, clock=clock, expire_at_open=False).set_tenant_ttl("alice", 10)
    assert engine_store.sweep() == 1  # `kvchat cache ttl` ran in another process
    assert all_files(root) == [root / TTL_FILE]


def test_the_shorter_of_code_and_file_wins(tmp_path, clock):
    root = tmp_path / "prefix"
    DiskPrefixStore(root, clock=clock).set_tenant_ttl("alice", 100)
    s = DiskPrefixStore(root, clock=clock, tenant_ttl_s={"alice": 500, "bob": 5})
    assert s.ttls.by_tenant == {"alice": 100, "bob": 5}
    s = DiskPrefixStore(root, clock=clock, tenant_ttl_s={"alice": 50})
    assert s.ttls.for_tenant("alice") == 50 and s.ttls.for_tenant("carol") == 24 * 3600


@pytest.mark.parametrize("ttl", [0, -1, math.inf, math.nan, "60", True])
def test_bad_ttls_are_refused(tmp_path, clock, ttl):
    s = DiskPrefixStore(tmp_path / "prefix", clock=clock)
    with pytest.raises(ValueError):
        s.set_tenant_ttl("alice", ttl)
    assert not (s.root / TTL_FILE).exists()


def test_a_ttl_file_that_is_not_private_or_not_valid_is_ignored(tmp_path, clock):
    root = tmp_path / "prefix"
    DiskPrefixStore(root, clock=clock).set_tenant_ttl("alice", 100)
    os.chmod(root / TTL_FILE, 0o666)  # anyone could have lengthened it
    assert DiskPrefixStore(root, clock=clock).ttls.by_tenant == {}
    for junk in ("[1, 2]", "{not json", json.dumps({"a": -1, "b": "x", "c": 1e400, "d": 7})):
        (root / TTL_FILE).write_text(junk)
        os.chmod(root / TTL_FILE, 0o600)
        assert DiskPrefixStore(root, clock=clock).ttls.by_tenant == ({"d": 7.0} if "d" in junk
                                                                    else {})


def test_expired_entries_can_be_kept_for_purge_to_count(tmp_path, clock):
    root = tmp_path / "prefix"
    s = DiskPrefixStore(root, clock=clock)
    for i in range(3):
        put(s, make_block(10 + i, ALICE), ttl_s=5)
    put(s, make_block(13, BOB), ttl_s=5)
    put(s, make_block(14))
    clock.t += 10
    kept = DiskPrefixStore(root, clock=clock, expire_at_open=False)
    assert kept.stats().entries == 5 and kept.stats().removed_by_reason == {}
    assert get(kept, make_block(13, BOB)) is None  # never served, though indexed
    assert kept.purge(tenant="alice", expired_only=True) == 3
    assert kept.purge(expired_only=True) == 0  # bob's went at the miss above
    assert DiskPrefixStore(root, clock=clock).stats().entries == 1
