"""Entry files on disk: modes, foreign files left alone, stale temp files swept, and crash
safety (a writer killed mid-write never leaves a torn entry that is served)."""

from __future__ import annotations

import os
import random
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from disk_blocks import Clock, all_files, entry_path, get, make_block, put, same

from engine.kvcache.disk.root import TEMP_NAME
from engine.kvcache.disk.store import TEMP_GRACE_S, TTL_FILE, DiskPrefixStore
from engine.kvcache.prefix_key import CacheSalt, chain_hash
from engine.paths import temp_path


@pytest.fixture
def clock():
    return Clock()


# ---- files on disk --------------------------------------------------------------------------


def test_modes(tmp_path, clock):
    root = tmp_path / "new" / "prefix"  # a missing parent too
    old = os.umask(0)  # even with a permissive umask
    try:
        store = DiskPrefixStore(root, clock=clock)
        put(store, make_block(70))
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "new").stat().st_mode) == 0o700
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    for p in all_files(root):
        assert stat.S_IMODE(p.stat().st_mode) == 0o600
        assert stat.S_IMODE(p.parent.stat().st_mode) == 0o700


def test_existing_directories_keep_their_modes(tmp_path, clock):
    root = tmp_path / "prefix"
    b = make_block(71)
    shard = root / b.hash.hex()[:2]
    shard.mkdir(parents=True)
    os.chmod(root, 0o755)
    os.chmod(shard, 0o750)
    store = DiskPrefixStore(root, clock=clock)
    assert put(store, b) and same(get(store, b), b.arrays)  # an existing private shard is used
    store.sweep()
    assert stat.S_IMODE(root.stat().st_mode) == 0o755
    assert stat.S_IMODE(shard.stat().st_mode) == 0o750


def test_garbage_in_the_directory_is_tolerated(tmp_path, clock):
    root = tmp_path / "prefix"
    with DiskPrefixStore(root, clock=clock) as s:
        good = make_block(80)
        put(s, good)
    shard = entry_path(s, good).parent
    junk_entry = shard / (("f" * 64) + ".kvb")
    junk_entry.write_bytes(b"KVCB" + os.urandom(100))
    (shard / (("e" * 64) + ".kvb")).write_bytes(b"")
    (shard / "README").write_text("hello")
    (shard / (("d" * 64) + ".kvb")).mkdir()
    (root / "notes.txt").write_text("not ours")
    (root / "zz").mkdir()
    (root / "zz" / "x.kvb").write_bytes(b"junk")
    (root / ("00" if shard.name != "00" else "01")).write_bytes(b"a file, not a shard dir")
    # a symlink named like an entry is neither indexed nor followed
    link_target = make_block(81)
    link = entry_path(s, link_target)
    link.parent.mkdir(exist_ok=True)
    link.symlink_to(entry_path(s, good))
    s2 = DiskPrefixStore(root, clock=clock)
    assert [e.hash for e in s2.entries()] == [good.hash.hex()]
    assert not junk_entry.exists() and not (shard / (("e" * 64) + ".kvb")).exists()
    assert (shard / "README").exists() and (root / "notes.txt").exists()  # not ours: kept
    assert same(get(s2, good), good.arrays)
    assert get(s2, link_target) is None
    assert s2.sweep() == 0


def test_stale_temp_files_are_removed(tmp_path, clock):
    root = tmp_path / "prefix"
    with DiskPrefixStore(root, clock=clock) as s:
        b = make_block(90)
        put(s, b)
    shard = entry_path(s, b).parent
    h = b.hash.hex()
    fresh, stale = temp_path(entry_path(s, b)), temp_path(entry_path(s, b))
    legacy = shard / f".{h}.cccccccccccc.tmp"  # the name kvchat used before
    at_root = temp_path(root / TTL_FILE)
    foreign = [shard / "notes.tmp", shard / f".{h}.x.tmp", shard / ".kvchat-x.tmp",
               temp_path(shard / "notes.txt"), root / f"{h}.kvb"]  # not where entries live
    old = time.time() - TEMP_GRACE_S - 5
    for p in (fresh, stale, legacy, at_root, *foreign):
        p.write_bytes(b"partial")
        if p is not fresh:
            os.utime(p, (old, old))
    s2 = DiskPrefixStore(root, clock=clock)
    assert fresh.exists() and not (stale.exists() or legacy.exists() or at_root.exists())
    os.utime(fresh, (old, old))
    s2.sweep()
    assert not fresh.exists()
    assert all(p.exists() for p in foreign)  # kvchat deletes only what it writes
    assert s2.stats().removed_by_reason == {"temp": 4}
    assert same(get(s2, b), b.arrays)



# ---- crash safety -----------------------------------------------------------------------------

ENGINE_DIR = str(Path(__file__).resolve().parents[1] / "engine")
# The child loads the store modules without `engine/__init__` (which loads MLX, ~2.5 s).
CHILD = r"""
import sys, types
pkg = types.ModuleType("engine"); pkg.__path__ = [sys.argv[1]]; sys.modules["engine"] = pkg
from pathlib import Path
import numpy as np
from engine.kvcache.disk.store import DiskPrefixStore
from engine.kvcache.prefix_key import CacheSalt, chain_hash
from engine.paths import temp_path
salt = CacheSalt("m", "t", "raw", "rope", "float32", 4)
store = DiskPrefixStore(Path(sys.argv[2]), budget_bytes=1 << 40)
run = int(sys.argv[3])
for i in range(1000):
    tokens = [run, i, 0, 0]
    arrays = [np.full((4, 4, 32768), run * 1000 + i + k, np.float32) for k in range(2)]
    print("writing", i, flush=True)
    store.put(salt, chain_hash(salt.digest(), tokens), salt.digest(), tokens, arrays)
    print("done", i, flush=True)
"""
CHILD_SALT = CacheSalt("m", "t", "raw", "rope", "float32", 4)


@pytest.mark.subprocess
def test_sigkill_mid_write_never_serves_a_torn_entry(tmp_path):
    root = tmp_path / "crash"
    rng = random.Random(0)
    last_done, temps_left = {}, set()
    for run in range(8):
        if run >= 4 and temps_left:
            break  # a kill inside a write is likely, not certain: retry a few times
        proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, ENGINE_DIR, str(root), str(run)],
            stdout=subprocess.PIPE,
            text=True,
        )
        last_done[run] = -1
        for line in proc.stdout:
            kind, i = line.split()
            if kind == "done":
                last_done[run] = int(i)
            elif int(i) == 2 + run % 4:
                break
        time.sleep(rng.uniform(0, 0.006))  # land inside the write, most of the time
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
        temps_left |= {p for p in all_files(root) if TEMP_NAME.fullmatch(p.name)}
    assert temps_left, "no kill landed mid-write; the test lost its point"

    store = DiskPrefixStore(root, budget_bytes=1 << 40)
    indexed = {e.hash for e in store.entries()}
    on_disk = {p.stem for p in all_files(root) if p.suffix == ".kvb"}
    assert indexed == on_disk  # temp files are never indexed
    served = 0
    for run, last in last_done.items():
        for i in range(last + 3):
            tokens = [run, i, 0, 0]
            got = store.get(CHILD_SALT, chain_hash(CHILD_SALT.digest(), tokens), tokens)
            if i <= last:
                assert got is not None  # put() returned: the entry is complete
            if got is not None:
                served += 1
                assert [float(a.flat[0]) for a in got] == [run * 1000 + i, run * 1000 + i + 1]
                assert all(np.all(a == a.flat[0]) for a in got)
    assert served == len(on_disk)
    assert store.stats().misses_by_reason.keys() <= {"absent"}
    shutil.rmtree(root)  # tens of MB; don't leave them in pytest's kept tmp dirs
