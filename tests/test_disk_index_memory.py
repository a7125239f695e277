"""The disk store's index in memory (issue 33 item 5): a server's RSS grew with every new
disk entry, ~12 KiB each, up to the disk budget (~5,800 entries of the default model,
~70 MB), because each indexed header kept its own copy of the salt, the spec and the
tensors' dtypes and shapes (60 of them for a 30-layer model). Entries of one salt now
share those, whether indexed by a write or by the start-up scan."""

from __future__ import annotations

import tracemalloc

import numpy as np
from disk_blocks import SALT, Block

from engine.kvcache.disk.store import DiskPrefixStore
from engine.kvcache.prefix_key import chain_hash

LAYERS = 30  # as the default model: K and V of each layer are one tensor each
N = 120


def block(i: int) -> Block:
    tokens = [1000 * i + k for k in range(SALT.block_size)]
    arrays = [np.full((3, SALT.block_size, 8), i, np.float32) for _ in range(2 * LAYERS)]
    return Block(SALT, chain_hash(SALT.digest(), tokens), SALT.digest(), tokens, arrays)


def headers(store: DiskPrefixStore) -> list:
    index = store._catalog.index
    return [index.get(h).header for h in list(index._entries)]


def assert_shared(hs: list) -> None:
    first = hs[0]
    assert all(h.salt is first.salt and h.spec is first.spec and h.tensors is first.tensors
               for h in hs)


def test_written_entries_share_their_salt_spec_and_tensor_list(tmp_path):
    store = DiskPrefixStore(tmp_path / "prefix")
    for i in range(N):
        assert store.put(SALT, *block(i)[1:])
    hs = headers(store)
    assert len(hs) == N
    assert_shared(hs)


def test_the_start_up_scan_indexes_entries_in_little_memory(tmp_path):
    root = tmp_path / "prefix"
    first = DiskPrefixStore(root)
    for i in range(N):
        assert first.put(SALT, *block(i)[1:])
    del first
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        store = DiskPrefixStore(root)  # the scan: every header parsed from its file
        per_entry = (tracemalloc.get_traced_memory()[0] - before) / N
    finally:
        tracemalloc.stop()
    print(f"index: {per_entry:.0f} bytes per entry")
    assert per_entry < 3000, per_entry  # ~12,000 when each header kept its own tensor list
    hs = headers(store)
    assert len(hs) == N
    assert_shared(hs)
