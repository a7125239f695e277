"""Disk prefix store: real files in tmp_path, an injectable clock, faults injected into bytes."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from disk_blocks import (
    BS,
    SALT,
    T0,
    Clock,
    all_files,
    assert_miss_removed,
    entry_path,
    get,
    make_block,
    put,
    same,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.kvcache.disk import entry as disk_entry
from engine.kvcache.disk.store import DiskPrefixStore


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def store(tmp_path, clock):
    s = DiskPrefixStore(tmp_path / "prefix", clock=clock)
    yield s
    s.close()


# ---- round trips ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_round_trip(store, dtype):
    b = make_block(1, dataclasses.replace(SALT, kv_format=np.dtype(dtype).name), dtype=dtype)
    assert put(store, b)
    assert not put(store, b)  # already present
    assert same(get(store, b), b.arrays)
    s = store.stats()
    assert (s.entries, s.writes, s.hits, s.misses) == (1, 1, 1, 0)
    assert s.bytes == entry_path(store, b).stat().st_size


def test_bfloat16_round_trips_as_uint16_bits(store):
    salt = dataclasses.replace(SALT, kv_format="bfloat16")
    keys = mx.random.normal((2, BS, 8)).astype(mx.bfloat16)
    bits = np.array(mx.view(keys, mx.uint16))
    b = make_block(2, salt)._replace(arrays=[bits, bits + 1])
    assert put(store, b)
    path = entry_path(store, b)
    with open(path, "rb") as f:
        header = disk_entry.read_header(f, path.stat().st_size)
    assert [d for d, _ in header.tensors] == ["bfloat16", "bfloat16"]
    got = get(store, b)
    assert same(got, b.arrays)
    back = mx.view(mx.array(got[0]), mx.bfloat16)
    assert back.dtype == mx.bfloat16 and mx.array_equal(back, keys).item()


def test_survives_restart(tmp_path, clock):
    root = tmp_path / "prefix"
    blocks = [make_block(i) for i in range(3)]
    with DiskPrefixStore(root, clock=clock) as s:
        for b in blocks:
            assert put(s, b)
    s2 = DiskPrefixStore(root, clock=clock)
    assert {e.hash for e in s2.entries()} == {b.hash.hex() for b in blocks}
    assert all(same(get(s2, b), b.arrays) for b in blocks)


@pytest.mark.parametrize(
    "change",
    [
        {"hash": b"\x00" * 32},  # not chain_hash(parent, tokens)
        {"tokens": [1, 2, 3]},  # not a full block
        {"arrays": []},
        {"arrays": [np.zeros((2, BS + 1, 8), np.float32)]},
        {"arrays": [np.zeros((2, BS, 8), np.float64)]},
    ],
)
def test_put_rejects_malformed_blocks(store, change):
    b = make_block(3)._replace(**change)
    with pytest.raises(ValueError):
        put(store, b)
    assert store.stats().entries == 0


# ---- every bad entry is a miss, removed, counted -------------------------------------------


def test_absent(store):
    b = make_block(4)
    assert get(store, b) is None
    assert store.stats().misses_by_reason == {"absent": 1}


@pytest.mark.parametrize("keep", ["empty", "prefix", "header", "payload", "minus1"])
def test_truncated_file_is_a_miss(tmp_path, store, keep):
    b = make_block(5)
    put(store, b)
    path = entry_path(store, b)
    data = path.read_bytes()
    header_len = int.from_bytes(data[6:10], "little")
    cut = {
        "empty": 0,
        "prefix": 5,
        "header": disk_entry.PREFIX.size + header_len // 2,
        "payload": len(data) - 100,
        "minus1": len(data) - 1,
    }[keep]
    path.write_bytes(data[:cut])
    assert_miss_removed(store, b, "corrupt")


def test_truncated_file_is_removed_at_start_up(tmp_path, clock):
    root = tmp_path / "prefix"
    b, good = make_block(6), make_block(7)
    with DiskPrefixStore(root, clock=clock) as s:
        put(s, b)
        put(s, good)
        path = entry_path(s, b)
    path.write_bytes(path.read_bytes()[:-10])
    s2 = DiskPrefixStore(root, clock=clock)
    assert not path.exists()
    assert s2.stats().removed_by_reason == {"corrupt": 1}
    assert [e.hash for e in s2.entries()] == [good.hash.hex()]


def _flip(path: Path, region: str) -> None:
    data = bytearray(path.read_bytes())
    header_len = int.from_bytes(data[6:10], "little")
    start = disk_entry.PREFIX.size
    offset = {
        "magic": 1,
        "header": start + header_len // 2,
        "header_first": start,
        "payload": start + header_len + 7,
        "payload_last": len(data) - disk_entry.DIGEST_SIZE - 1,
        "checksum": len(data) - 3,
    }[region]
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "region", ["magic", "header", "header_first", "payload", "payload_last", "checksum"]
)
def test_flipped_byte_is_a_miss(store, region):
    b = make_block(8)
    put(store, b)
    _flip(entry_path(store, b), region)
    assert_miss_removed(store, b, "corrupt")


@pytest.mark.parametrize(
    "field, value",
    [
        ("model_fingerprint", "sha256:model-b"),
        ("tokenizer_fingerprint", "sha256:tok-b"),
        ("block_size", 8),
        ("tenant", "mallory"),
        ("permission_version", 1),
        ("prompt_version", "tmpl:1"),
        ("position", "rope_theta=500000,traditional=False,scaling=None"),
        ("kv_format", "q8g64"),
    ],
)
def test_foreign_entry_is_a_miss(store, field, value):
    b = make_block(9)
    put(store, b)
    other = dataclasses.replace(SALT, **{field: value})
    assert_miss_removed(store, b, "foreign", salt=other)


# FORMAT_VERSION - 1: the float-only format before entries recorded their KV format
@pytest.mark.parametrize("version", [0, disk_entry.FORMAT_VERSION - 1,
                                     disk_entry.FORMAT_VERSION + 1])
def test_other_format_version_is_a_miss(tmp_path, clock, version):
    root = tmp_path / "prefix"
    b, b2 = make_block(10), make_block(11)
    with DiskPrefixStore(root, clock=clock) as s:
        put(s, b)
        put(s, b2)
    for x in (b, b2):
        path = entry_path(s, x)
        data = bytearray(path.read_bytes())
        data[4:6] = version.to_bytes(2, "little")
        path.write_bytes(bytes(data))
    # at start-up the scan drops both (header read only) ...
    s2 = DiskPrefixStore(root, clock=clock)
    assert s2.stats().removed_by_reason == {"old_format": 2}
    assert all_files(root) == []
    # ... and a file that appears later is a miss on read
    with DiskPrefixStore(root, clock=clock) as s3:
        put(s3, b)
    path = entry_path(s3, b)
    data = bytearray(path.read_bytes())
    data[4:6] = version.to_bytes(2, "little")
    path.write_bytes(bytes(data))
    assert_miss_removed(s3, b, "old_format")


def test_old_format_written_by_helper_is_removed(store):
    b = make_block(12)
    header = disk_entry.EntryHeader(
        salt=b.salt,
        block_hash=b.hash,
        parent_hash=b.parent,
        token_ids=b.tokens,
        created=T0,
        expires=T0 + 100,
        spec=disk_entry.EntrySpec.infer(b.arrays),
        tensors=[(disk_entry.dtype_name(a), a.shape) for a in b.arrays],
    )
    path = entry_path(store, b)
    path.parent.mkdir(mode=0o700)
    with open(path, "wb") as f:
        disk_entry.write_entry(f, header, b.arrays, version=0)
    assert_miss_removed(store, b, "old_format")


def test_expired_entry_is_a_miss(store, clock):
    b = make_block(13)
    put(store, b, ttl_s=60)
    clock.t += 59
    assert same(get(store, b), b.arrays)
    clock.t += 1
    assert_miss_removed(store, b, "expired")
    assert store.stats().expired_removed == 1


def test_token_mismatch_is_a_miss(store):
    b = make_block(14)
    put(store, b)
    assert_miss_removed(store, b, "mismatch", tokens=[9, 9, 9, 9])


def test_tenants_never_share_disk_entries(store):
    alice = make_block(15, dataclasses.replace(SALT, tenant="alice"))
    bob = make_block(15, dataclasses.replace(SALT, tenant="bob"))
    assert alice.tokens == bob.tokens and alice.hash != bob.hash
    put(store, alice)
    assert get(store, bob) is None  # bob's own key: absent
    assert store.stats().hits == 0
    bumped = make_block(15, dataclasses.replace(alice.salt, permission_version=1))
    assert get(store, bumped) is None
    assert store.purge(tenant="alice", permission_below=1) == 1
    assert store.stats().entries == 0


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_any_damage_is_never_served(tmp_path_factory, data):
    root = tmp_path_factory.mktemp("fuzz")
    store = DiskPrefixStore(root, clock=Clock())
    b = make_block(16)
    put(store, b)
    path = entry_path(store, b)
    pristine = path.read_bytes()
    if data.draw(st.booleans()):
        i = data.draw(st.integers(0, len(pristine) - 1))
        damaged = bytearray(pristine)
        damaged[i] ^= data.draw(st.integers(1, 255))
    else:
        damaged = pristine[: data.draw(st.integers(0, len(pristine) - 1))]
    path.write_bytes(bytes(damaged))
    assert get(store, b) is None
    assert not path.exists()
    # nor after a restart (the scan reads headers only; get() checks the rest)
    path.write_bytes(bytes(damaged))
    assert get(DiskPrefixStore(root, clock=Clock()), b) is None
