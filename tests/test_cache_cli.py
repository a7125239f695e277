"""`kvchat cache ...` and the cache flags of `kvchat generate`, as real processes on real files."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest

DOC = ("The block-paged KV cache keeps keys and values in fixed-size blocks. " * 30)


def kvchat(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "app", *args], capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ))


def generate(cache_dir, *extra) -> dict:
    proc = kvchat("generate", "--prompt", DOC + "\nSummarize.", "--json", "--max-tokens", "8",
                  "--cache-dir", str(cache_dir), *extra)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def stats(cache_dir) -> dict:
    proc = kvchat("cache", "stats", "--json", "--cache-dir", str(cache_dir))
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.slow
def test_generate_restores_from_disk_in_a_new_process_and_purge_by_tenant(tmp_path):
    d = tmp_path / "prefix"
    cold = generate(d, "--tenant", "alice")
    assert cold["cache_source"] == "none" and cold["cached_tokens"] == 0
    warm = generate(d, "--tenant", "alice")  # a new process: only the disk can serve it
    assert warm["cache_source"] == "disk" and warm["cached_tokens"] > 300
    assert warm["tokens"] == cold["tokens"]
    other = generate(d, "--tenant", "bob")  # same text, another tenant: nothing shared
    assert other["cache_source"] == "none"
    st = stats(d)
    assert set(st["tenants"]) == {"alice", "bob"}
    assert st["tenants"]["alice"] == st["tenants"]["bob"] == warm["cached_tokens"] // 16 + 1
    # private: 0700 directories, 0600 files
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    for root, dirs, files in os.walk(d):
        for name in dirs:
            assert stat.S_IMODE(os.stat(os.path.join(root, name)).st_mode) == 0o700
        for name in files:
            assert stat.S_IMODE(os.stat(os.path.join(root, name)).st_mode) == 0o600
    ls = kvchat("cache", "ls", "--json", "--cache-dir", str(d))
    rows = json.loads(ls.stdout)
    assert len(rows) == st["entries"] and {r["tenant"] for r in rows} == {"alice", "bob"}
    purge = kvchat("cache", "purge", "--tenant", "alice", "--cache-dir", str(d))
    assert purge.returncode == 0 and f"removed {st['tenants']['alice']} entries" in purge.stdout
    assert stats(d)["tenants"] == {"bob": st["tenants"]["bob"]}
    again = generate(d, "--tenant", "alice")
    assert again["cache_source"] == "none"
    # a permission bump: the old scope is unreachable
    bumped = generate(d, "--tenant", "bob", "--permission-version", "1")
    assert bumped["cache_source"] == "none"
    assert kvchat("cache", "purge", "--all", "--cache-dir", str(d)).returncode == 0
    assert stats(d)["entries"] == 0


def test_no_disk_cache_writes_nothing(tmp_path):
    d = tmp_path / "prefix"
    out = generate(d, "--no-disk-cache")
    assert out["cache_source"] == "none"
    assert not d.exists() or not any(f for _, _, f in os.walk(d) if f)


def test_purge_without_a_filter_is_a_clear_error(tmp_path):
    proc = kvchat("cache", "purge", "--cache-dir", str(tmp_path))
    assert proc.returncode == 2 and "purge needs" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_cache_verify_cold_warm_ram_warm_disk(tmp_path):
    proc = kvchat("cache", "verify", "--cache-dir", str(tmp_path / "v"), "--max-tokens", "12")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK: identical greedy tokens" in proc.stdout
    assert "warm (disk, new process)" in proc.stdout
