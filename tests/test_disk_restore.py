"""Restoring a prefix from the disk store into the pool: in batches (one write per tensor for
a run of consecutive blocks, not one per block), byte for byte wherever the blocks land.

Issue 33 item 6: one scatter per block and tensor (60 per block of the default model) was two
thirds of a 2.4k-token restore; the speed is `kvchat bench prefix`'s restart row, here only
the shape of the work and its result.
"""

from __future__ import annotations

import threading
from collections import deque

import pytest
from test_disk_quant import BS, entries, prefill, prefix_cache, stored

from engine.kvcache import prefix_cache as pc_module
from engine.kvcache.block_manager import BlockManager
from engine.kvcache.kv_cache import PagedKVCache

IDS = list(range(200, 221))  # 5 full blocks to restore (the last token is always computed)


def count_puts(monkeypatch) -> list[object]:
    """Record the ``slots`` of every `PagedKVCache.put` (an array, or a slice of a run)."""
    calls: list[object] = []
    put = PagedKVCache.put

    def spy(self, slots, keys, values):
        calls.append(slots)
        return put(self, slots, keys, values)

    monkeypatch.setattr(PagedKVCache, "put", spy)
    return calls


@pytest.mark.parametrize("fmt", ["f32", "f16", "q8", "k8v4"])
def test_a_run_of_blocks_is_restored_in_one_write(tmp_path, monkeypatch, fmt):
    writer = prefix_cache(fmt, tmp_path)
    assert prefill(writer, IDS) == (0, "none")
    calls = count_puts(monkeypatch)
    reader = prefix_cache(fmt, tmp_path)  # a fresh pool: its blocks are 0, 1, 2, ...
    assert prefill(reader, IDS, seed=1) == (20, "disk")
    assert len(calls) == 1 and isinstance(calls[0], slice)  # was one put per block
    assert stored(reader, 20) == stored(writer, 20)
    assert reader.disk_hits == 5


@pytest.mark.parametrize("max_runs", [8, 1], ids=["slices", "scatter"])
@pytest.mark.parametrize("fmt", ["f32", "q8"])
def test_blocks_scattered_over_the_pool_come_back_exactly(tmp_path, monkeypatch, fmt,
                                                          max_runs):
    writer = prefix_cache(fmt, tmp_path)
    prefill(writer, IDS)
    monkeypatch.setattr(pc_module, "MAX_SLICE_RUNS", max_runs)
    blocks = BlockManager(16, BS)
    blocks.free_block_ids = deque([9, 3, 4, 12, 0, *sorted(set(range(16)) - {9, 3, 4, 12, 0})])
    calls = count_puts(monkeypatch)
    reader = prefix_cache(fmt, tmp_path, blocks)
    assert prefill(reader, IDS, seed=1) == (20, "disk")
    assert blocks.block_tables[0][:5] == [9, 3, 4, 12, 0]
    assert stored(reader, 20) == stored(writer, 20)
    # four runs (9 | 3 4 | 12 | 0) as slices, or past the limit one scatter for all
    assert len(calls) == (4 if max_runs == 8 else 1)


def test_batches_are_bounded_and_a_bad_entry_ends_the_restore(tmp_path, monkeypatch):
    writer = prefix_cache("f32", tmp_path)
    prefill(writer, IDS)
    block_bytes = writer.kv.layout.bytes_per_block
    monkeypatch.setattr(pc_module, "RESTORE_BATCH_BYTES", 2 * block_bytes)  # 2 per batch
    fourth = writer.store.files.path(writer.hashes(writer.new_sequence("local", 0), IDS)[3])
    data = bytearray(fourth.read_bytes())
    data[-40] ^= 1  # payload damage: the checksum fails
    fourth.write_bytes(bytes(data))
    calls = count_puts(monkeypatch)
    reader = prefix_cache("f32", tmp_path)
    cached, source = prefill(reader, IDS, seed=1)
    assert (cached, source) == (12, "disk")  # blocks 0-2; the corrupt 4th is a miss
    assert len(calls) == 2  # blocks [0, 1], then [2]
    assert stored(reader, 12) == stored(writer, 12)
    assert reader.store.stats().misses_by_reason == {"corrupt": 1}
    assert len(entries(tmp_path)) == 5  # the bad one deleted, the rest rewritten by prefill


def test_blocks_are_read_and_checksummed_ahead_once_and_judged_in_order(tmp_path, monkeypatch):
    from engine.kvcache.disk import entry as disk_entry
    from engine.kvcache.disk import files as disk_files

    writer = prefix_cache("f32", tmp_path)
    prefill(writer, IDS)
    hashes = writer.hashes(writer.new_sequence("local", 0), IDS)
    second = writer.store.files.path(hashes[1])
    data = bytearray(second.read_bytes())
    data[-40] ^= 1  # the second block's payload is damaged
    second.write_bytes(bytes(data))
    threads, checks = [], []
    read_checked, checksum_ok = disk_files.EntryFiles.read_checked, disk_entry.checksum_ok

    def spy_read(self, *args):
        threads.append(threading.current_thread().name)
        return read_checked(self, *args)

    def spy_checksum(data):
        checks.append(len(data))
        return checksum_ok(data)

    monkeypatch.setattr(disk_files.EntryFiles, "read_checked", spy_read)
    monkeypatch.setattr(disk_entry, "checksum_ok", spy_checksum)
    reader = prefix_cache("f32", tmp_path)
    assert prefill(reader, IDS, seed=1) == (4, "disk")  # block 0; block 1 is corrupt
    assert threads and all(t.startswith("kvchat-prefix-reader") for t in threads)
    assert len(checks) == len(threads)  # one checksum per read, none again when judged
    st = reader.store.stats()
    # blocks read ahead past the miss were neither counted nor touched nor deleted
    assert (st.hits, st.misses_by_reason) == (1, {"corrupt": 1})
    assert stored(reader, 4) == stored(writer, 4)
    reader.store.close()
