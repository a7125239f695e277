"""Foreign directories: the store reads only what it can trust, writes only into real private
directories of its own, deletes only what it wrote, and degrades instead of failing."""

from __future__ import annotations

import errno
import os
import stat
import time
from pathlib import Path

import pytest
from disk_blocks import Clock, all_files, entry_path, get, make_block, put, same

from engine.errors import KVChatError
from engine.kvcache.disk import files as disk_files
from engine.kvcache.disk import root as disk_root
from engine.kvcache.disk.store import DiskPrefixStore

NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown")
not_root = pytest.mark.skipif(os.geteuid() == 0, reason="root ignores permission bits")


@pytest.fixture
def clock():
    return Clock()


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def filled(root: Path, clock, *blocks, **kw) -> list[Path]:
    """A store at ``root`` holding ``blocks``; their entry paths."""
    with DiskPrefixStore(root, clock=clock) as s:
        for b in blocks:
            assert put(s, b, **kw)
    return [entry_path(s, b) for b in blocks]


def same_shard_block(b, start: int = 1000):
    """Another block whose entry lands in the same shard directory as ``b``'s."""
    return next(c for i in range(start, start + 20_000)
                if (c := make_block(i)).hash.hex()[:2] == b.hash.hex()[:2])


# ---- the root -------------------------------------------------------------------------------


def test_symlinked_root_is_used_read_only(tmp_path, clock):
    real, link = tmp_path / "real", tmp_path / "link"
    b, old = make_block(1), make_block(2)
    paths = filled(real, clock, b) + filled(real, clock, old, ttl_s=5)
    os.chmod(real, 0o750)
    link.symlink_to(real)
    clock.t += 10  # ``old`` has expired
    s = DiskPrefixStore(link, clock=clock)
    assert s.degraded.startswith("disk cache read-only") and "symlink" in s.degraded
    assert not s.writable
    assert same(get(s, b), b.arrays)  # reads are served
    assert not put(s, make_block(3)) and s.stats().dropped_writes == 1
    assert s.purge(all=True) == 0 and s.sweep() == 0
    with pytest.raises(KVChatError, match="read-only"):
        s.set_tenant_ttl("local", 60)
    assert all(p.exists() for p in paths) and len(all_files(real)) == 2  # nothing written
    assert mode(real) == 0o750  # nor chmodded


@pytest.mark.parametrize("bits", [0o770, 0o707, 0o1777])
def test_root_writable_by_others_is_not_used(tmp_path, clock, bits):
    root = tmp_path / "shared"
    b = make_block(4)
    (path,) = filled(root, clock, b)
    os.chmod(root, bits)
    s = DiskPrefixStore(root, clock=clock)
    assert s.degraded.startswith("disk cache off") and "not private" in s.degraded
    assert get(s, b) is None and s.stats().misses_by_reason == {"disabled": 1}
    assert s.entries() == [] and not put(s, make_block(5))
    assert s.purge(all=True) == 0 and s.sweep() == 0
    assert mode(root) == bits  # a 1777 directory keeps its sticky bit
    assert path.exists() and all_files(root) == [path]


@as_root
def test_root_of_another_user_is_not_used(tmp_path, clock):
    root = tmp_path / "theirs"
    (path,) = filled(root, clock, make_block(6))
    os.chown(root, NOBODY, NOBODY)
    s = DiskPrefixStore(root, clock=clock)
    assert s.degraded.startswith("disk cache off") and s.entries() == []
    assert path.exists() and os.stat(root).st_uid == NOBODY


def test_root_that_cannot_be_created_turns_the_store_off(tmp_path, clock):
    (tmp_path / "a-file").write_text("not a directory")
    s = DiskPrefixStore(tmp_path / "a-file" / "prefix", clock=clock)
    assert s.degraded.startswith("disk cache off")
    b = make_block(7)
    assert get(s, b) is None and not put(s, b) and s.entries() == []


def test_read_only_root_serves_and_keeps_everything(tmp_path, clock, monkeypatch):
    root = tmp_path / "prefix"
    b, bad = make_block(8), make_block(9)
    paths = filled(root, clock, b, bad)
    paths[1].write_bytes(paths[1].read_bytes()[:-1])  # truncated
    monkeypatch.setattr(disk_root.os, "access", lambda *a, **k: False)
    s = DiskPrefixStore(root, clock=clock)
    assert s.degraded == f"disk cache read-only: {root} is not writable"
    assert same(get(s, b), b.arrays)
    assert get(s, bad) is None and paths[1].exists()  # a miss, but not ours to delete now
    assert not put(s, make_block(10))


@not_root
def test_really_read_only_root(tmp_path, clock):
    root = tmp_path / "prefix"
    b = make_block(11)
    filled(root, clock, b)
    os.chmod(root, 0o500)
    try:
        s = DiskPrefixStore(root, clock=clock)
        assert "read-only" in s.degraded and same(get(s, b), b.arrays)
        assert not put(s, make_block(12))
    finally:
        os.chmod(root, 0o700)


# ---- writes that fail ------------------------------------------------------------------------


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES])
def test_full_or_read_only_disk_stops_writes_with_one_warning(tmp_path, clock, monkeypatch,
                                                               code):
    s = DiskPrefixStore(tmp_path / "prefix", clock=clock)
    b0, b1, b2 = make_block(13), make_block(14), make_block(15)
    assert put(s, b0)

    def full(*args, **kw):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(disk_files, "write_temp", full)
    assert not put(s, b1)
    warning = s.degraded
    assert warning.startswith("disk cache writes stopped") and os.strerror(code) in warning
    assert not s.writable
    assert not put(s, b2) and not s.put_async(b2.salt, b2.hash, b2.parent, b2.tokens, b2.arrays)
    assert s.degraded == warning  # one warning, however many writes
    st = s.stats()
    assert (st.writes, st.write_errors, st.dropped_writes) == (1, 1, 2)
    assert st.to_dict()["write_errors"] == 1
    assert same(get(s, b0), b0.arrays)  # reads still work
    s.close()


def test_a_directory_at_an_entry_path_is_a_miss_then_cleared(tmp_path, clock):
    # issue 33 item 13: it used to cost that block for good (every write failed); kvchat
    # never makes a directory there, in its private shard: cleared (tests/test_disk_recovery.py)
    root = tmp_path / "prefix"
    s = DiskPrefixStore(root, clock=clock)
    b = make_block(16)
    blocker = entry_path(s, b)
    (blocker / "inside").mkdir(parents=True)
    assert get(s, b) is None and s.stats().misses_by_reason == {"io_error": 1}
    assert not blocker.exists() and s.stats().removed_by_reason == {"io_error": 1}
    assert put(s, b) and same(get(s, b), b.arrays)
    assert s.stats().write_errors == 0 and s.writable and s.degraded is None
    assert put(s, same_shard_block(b))  # the same shard takes writes
    assert [p.name for p in blocker.parent.iterdir() if disk_root.TEMP_NAME.fullmatch(p.name)] == []


def test_fifo_at_an_entry_path_is_a_miss_without_hanging(tmp_path, clock):
    s = DiskPrefixStore(tmp_path / "prefix", clock=clock)
    b = make_block(17)
    path = entry_path(s, b)
    path.parent.mkdir(mode=0o700)
    os.mkfifo(path)
    t = time.perf_counter()
    assert get(s, b) is None
    assert DiskPrefixStore(s.root, clock=clock).entries() == []
    assert time.perf_counter() - t < 5 and stat.S_ISFIFO(os.lstat(path).st_mode)


# ---- shards ----------------------------------------------------------------------------------


def test_symlinked_shard_is_never_followed(tmp_path, clock):
    root, outside = tmp_path / "prefix", tmp_path / "outside"
    b = make_block(18)
    (planted,) = filled(outside, clock, b)  # a valid entry, but outside the root
    root.mkdir(mode=0o700)
    shard = root / planted.parent.name
    shard.symlink_to(planted.parent)
    s = DiskPrefixStore(root, clock=clock)
    assert s.entries() == []
    assert get(s, b) is None and s.stats().misses_by_reason == {"unsafe_dir": 1}
    # the link itself is gone (issue 33 item 13: it kept the shard off disk for good), and
    # the shard is a real private directory again at the next write
    assert not shard.is_symlink()
    assert put(s, same_shard_block(b)) and s.stats().write_errors == 0
    assert mode(shard) == 0o700 and not shard.is_symlink()
    assert s.writable and s.degraded is None
    s.purge(all=True)
    s.sweep()
    assert all_files(outside) == [planted]  # nothing written, nothing deleted out there


def test_shard_writable_by_others_is_not_used(tmp_path, clock):
    root = tmp_path / "prefix"
    b = make_block(19)
    (path,) = filled(root, clock, b)
    os.chmod(path.parent, 0o777)
    s = DiskPrefixStore(root, clock=clock)
    assert s.entries() == [] and get(s, b) is None
    assert not put(s, same_shard_block(b))
    assert path.exists() and mode(path.parent) == 0o777  # not chmodded either
