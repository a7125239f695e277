"""The store recovers from what kvchat never makes in its private directory (issue 33 item 13):
a directory at an entry's path, or a symlink at a shard's name, used to keep that block (or
the 1/256 of blocks in that shard) off disk for good, so a prefix through it was capped at it
in every later run. Now the write (or the read that finds it) clears it, without following a
link or touching anything outside the cache, and a read-only store leaves it alone.
"""

from __future__ import annotations

import os
import stat

import pytest
from disk_blocks import Clock, entry_path, get, make_block, put, same

from engine.kvcache.disk.store import DiskPrefixStore


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def outside(tmp_path):
    """A directory outside the cache with a file that must survive everything."""
    path = tmp_path / "outside"
    path.mkdir()
    (path / "keep.txt").write_text("not the cache's")
    return path


def test_a_write_clears_a_directory_at_its_entry_path(tmp_path, clock, outside):
    s = DiskPrefixStore(tmp_path / "prefix", clock=clock)
    b = make_block(1)
    blocker = entry_path(s, b)
    (blocker / "sub").mkdir(parents=True)
    (blocker / "sub" / "file").write_bytes(b"x")
    (blocker / "link").symlink_to(outside)  # removing the directory must not follow it
    (blocker / "sub" / "file-link").symlink_to(outside / "keep.txt")
    assert put(s, b)  # was: a write error at every try
    assert stat.S_ISREG(os.lstat(blocker).st_mode) and same(get(s, b), b.arrays)
    assert s.stats().write_errors == 0
    assert sorted(p.name for p in outside.iterdir()) == ["keep.txt"]
    assert (outside / "keep.txt").read_text() == "not the cache's"


def test_a_write_replaces_a_symlinked_shard_with_a_private_directory(tmp_path, clock, outside):
    root = tmp_path / "prefix"
    s = DiskPrefixStore(root, clock=clock)
    b = make_block(2)
    shard = entry_path(s, b).parent
    shard.symlink_to(outside)
    assert put(s, b)  # was: never written (UnsafeDirError), for every block of the shard
    assert not shard.is_symlink() and stat.S_IMODE(os.lstat(shard).st_mode) == 0o700
    assert same(get(s, b), b.arrays)
    assert sorted(p.name for p in outside.iterdir()) == ["keep.txt"]  # nothing written there
    again = DiskPrefixStore(root, clock=clock)  # a restart serves it
    assert [e.hash for e in again.entries()] == [b.hash.hex()]


def test_a_prefix_through_a_blocked_entry_is_whole_on_disk_after_one_run(tmp_path, clock):
    root = tmp_path / "prefix"
    blocks = [make_block(i) for i in range(10, 14)]
    s = DiskPrefixStore(root, clock=clock)
    (entry_path(s, blocks[1]) / "x").mkdir(parents=True)
    entry_path(s, blocks[2]).parent.mkdir(mode=0o700, exist_ok=True)
    assert all(put(s, b) for b in blocks)
    s2 = DiskPrefixStore(root, clock=clock)
    assert all(same(get(s2, b), b.arrays) for b in blocks)


def test_a_read_only_store_leaves_them_alone(tmp_path, clock, outside):
    real = tmp_path / "real"
    s = DiskPrefixStore(real, clock=clock)
    b = make_block(3)
    c = next(x for i in range(4, 400) if (x := make_block(i)).hash[:1] != b.hash[:1])
    shard = entry_path(s, b).parent
    shard.symlink_to(outside)
    blocker = entry_path(s, c)
    blocker.mkdir(parents=True)
    link = tmp_path / "link"
    link.symlink_to(real)  # a symlinked root: read-only, nothing in it deleted
    ro = DiskPrefixStore(link, clock=clock)
    assert ro.state == "read-only"
    assert get(ro, b) is None and get(ro, c) is None and not put(ro, b)
    assert shard.is_symlink() and blocker.is_dir()
