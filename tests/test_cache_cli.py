"""`kvchat cache ...` and the cache flags of `kvchat generate` on real files.

The commands run in this process (`app.cli.main`, the session's model, a fresh engine per
command); the restore in a new process is `kvchat cache verify`'s own child process here,
and `kvchat ask`'s restart in test_ask.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import stat
import tempfile
import time
from pathlib import Path

import pytest

DOC = ("The block-paged KV cache keeps keys and values in fixed-size blocks. " * 30)


@pytest.fixture
def kvchat(kvchat_cli):
    """`kvchat ARGS` in this process, on the session's model: (exit status, stdout, stderr).
    Each command builds its own engine, so RAM holds nothing of an earlier command: what a
    warm command is served from beyond its own prompt is the disk store."""
    return kvchat_cli


@pytest.fixture
def generate(kvchat):
    def run(cache_dir, *extra) -> dict:
        code, out, err = kvchat("generate", "--prompt", DOC + "\nSummarize.", "--json",
                                "--max-tokens", "8", "--cache-dir", str(cache_dir), *extra)
        assert code == 0, err
        return json.loads(out)

    return run


@pytest.fixture
def stats(kvchat):
    def run(cache_dir) -> dict:
        code, out, err = kvchat("cache", "stats", "--json", "--cache-dir", str(cache_dir))
        assert code == 0, err
        return json.loads(out)

    return run


@pytest.mark.slow
def test_generate_restores_from_disk_in_a_new_engine_and_purge_by_tenant(tmp_path, kvchat,
                                                                         generate, stats):
    d = tmp_path / "prefix"
    cold = generate(d, "--tenant", "alice")
    assert cold["cache_source"] == "none" and cold["cached_tokens"] == 0
    warm = generate(d, "--tenant", "alice")  # a new engine: only the disk can serve it
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
    _, out, _ = kvchat("cache", "ls", "--json", "--cache-dir", str(d))
    rows = json.loads(out)["entries"]
    assert len(rows) == st["entries"] and {r["tenant"] for r in rows} == {"alice", "bob"}
    code, out, _ = kvchat("cache", "purge", "--tenant", "alice", "--cache-dir", str(d))
    assert code == 0 and f"removed {st['tenants']['alice']} entries" in out
    assert stats(d)["tenants"] == {"bob": st["tenants"]["bob"]}
    again = generate(d, "--tenant", "alice")
    assert again["cache_source"] == "none"
    # a permission bump: the old scope is unreachable
    bumped = generate(d, "--tenant", "bob", "--permission-version", "1")
    assert bumped["cache_source"] == "none"
    assert kvchat("cache", "purge", "--all", "--cache-dir", str(d))[0] == 0
    assert stats(d)["entries"] == 0


def test_no_disk_cache_writes_nothing(tmp_path, generate):
    d = tmp_path / "prefix"
    out = generate(d, "--no-disk-cache")
    assert out["cache_source"] == "none"
    assert not d.exists() or not any(f for _, _, f in os.walk(d) if f)


def test_purge_without_a_filter_is_a_clear_error(tmp_path, kvchat):
    code, _, err = kvchat("cache", "purge", "--cache-dir", str(tmp_path))
    assert code == 2 and "purge needs" in err
    assert "Traceback" not in err


@pytest.mark.slow
@pytest.mark.subprocess
def test_cache_verify_cold_warm_ram_warm_disk(tmp_path, kvchat):
    # cold and warm (RAM) here, then kvchat's own fresh process restores from disk
    code, out, err = kvchat("cache", "verify", "--cache-dir", str(tmp_path / "v"),
                            "--max-tokens", "12")
    assert code == 0, out + err
    assert "OK: identical greedy tokens" in out
    assert "warm (disk, new process)" in out


# ---- the store's commands, in-process on stores filled by the test (no model) ---------------


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    from app.cli import main

    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def fill(root, blocks, *, age_s: float = 0.0, ttl_s: float | None = None) -> None:
    """Write blocks as if ``age_s`` ago (so a short ``ttl_s`` has them expired now)."""
    from disk_blocks import Clock, put

    from engine.kvcache.disk.store import DiskPrefixStore

    with DiskPrefixStore(root, clock=Clock(time.time() - age_s)) as s:
        for b in blocks:
            assert put(s, b, ttl_s=ttl_s)


def tenant_blocks(tenant: str, first: int, n: int = 1, **salt):
    from disk_blocks import SALT, make_block

    return [make_block(first + i, dataclasses.replace(SALT, tenant=tenant, **salt))
            for i in range(n)]


def assert_one_line_error(code: int, err: str, *words: str) -> None:
    assert code == 2 and err.startswith("kvchat: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err and all(w in err for w in words), err


def test_stats_shows_write_errors(tmp_path, capsys):
    d = tmp_path / "prefix"
    fill(d, tenant_blocks("alice", 0, 2))
    code, out, err = run_cli(capsys, "cache", "stats", "--json", "--cache-dir", str(d))
    st = json.loads(out)
    assert code == 0 and err == ""
    assert (st["entries"], st["write_errors"], st["degraded"]) == (2, 0, None)
    code, out, _ = run_cli(capsys, "cache", "stats", "--cache-dir", str(d))
    assert code == 0 and "write errors: 0" in out


def test_purge_expired_reports_true_counts(tmp_path, capsys):
    d = tmp_path / "prefix"
    fill(d, tenant_blocks("alice", 20))  # alive
    fill(d, tenant_blocks("alice", 0, 2) + tenant_blocks("bob", 10), age_s=100, ttl_s=10)
    code, out, _ = run_cli(capsys, "cache", "purge", "--expired", "--tenant", "alice",
                           "--cache-dir", str(d))
    assert code == 0 and "removed 2 entries" in out  # bob's expired one is not alice's
    code, out, _ = run_cli(capsys, "cache", "purge", "--expired", "--cache-dir", str(d))
    assert code == 0 and "removed 1 entries" in out
    _, out, _ = run_cli(capsys, "cache", "stats", "--json", "--cache-dir", str(d))
    assert json.loads(out)["entries"] == 1


def test_purge_below_a_permission_version(tmp_path, capsys):
    d = tmp_path / "prefix"
    old = [*tenant_blocks("alice", 0), *tenant_blocks("alice", 1, permission_version=1)]
    fill(d, old + tenant_blocks("alice", 2, permission_version=2) + tenant_blocks("bob", 3))
    code, out, _ = run_cli(capsys, "cache", "purge", "--tenant", "alice",
                           "--permission-below", "2", "--cache-dir", str(d))
    assert code == 0 and "removed 2 entries" in out
    _, out, _ = run_cli(capsys, "cache", "ls", "--json", "--cache-dir", str(d))
    assert sorted((r["tenant"], r["permission_version"]) for r in json.loads(out)["entries"]) == [
        ("alice", 2), ("bob", 0)]
    code, _, err = run_cli(capsys, "cache", "purge", "--permission-below", "2",
                           "--cache-dir", str(d))
    assert_one_line_error(code, err, "--permission-below needs --tenant")


@pytest.mark.parametrize("args", [
    ["purge", "--tenant", "a", "--permission-below", "-1"],
    ["purge", "--tenant", "a", "--permission-below", "0"],
    ["purge", "--tenant", "a", "--permission-below", "1.5"],
    ["purge", "--tenant", "a", "--permission-below", "x"],
    ["purge", "--tenant", "a", "--permission-below", str(2**70)],
    ["purge", "--tenant", "", "--all"],
    ["purge", "--model", "", "--all"],
    ["ttl", "--tenant", "a", "0"],
    ["ttl", "--tenant", "a", "-5"],
    ["ttl", "--tenant", "a", "inf"],
    ["ttl", "--tenant", "a", "nan"],
    ["ttl", "--tenant", "a", "1e400"],
    ["ttl", "--tenant", "a", "5y"],
    ["ttl", "--tenant", "a", "3651d"],
    ["ttl", "--tenant", "a", "soon"],
    ["ttl", "--tenant", "a", "60", "--clear"],
    ["ttl", "--tenant", "", "60"],
    ["ttl", "60"],
    ["verify", "--max-tokens", "0"],
    ["verify", "--prompt-file", "/dev/zero"],
])
def test_bad_values_get_one_line_and_exit_2(tmp_path, capsys, args):
    d = tmp_path / "prefix"
    code, out, err = run_cli(capsys, "cache", *args, "--cache-dir", str(d))
    assert_one_line_error(code, err)
    assert out == ""


def test_ttl_set_list_and_clear(tmp_path, capsys):
    d = tmp_path / "prefix"
    fill(d, tenant_blocks("alice", 0), age_s=7200)  # two hours old, default TTL of 24 h
    fill(d, tenant_blocks("alice", 1) + tenant_blocks("bob", 2))
    code, out, _ = run_cli(capsys, "cache", "ttl", "--tenant", "alice", "1h",
                           "--cache-dir", str(d))
    assert code == 0 and "tenant alice: TTL 1h; removed 1 entries" in out
    code, out, _ = run_cli(capsys, "cache", "ttl", "--json", "--cache-dir", str(d))
    assert code == 0 and json.loads(out) == {"alice": 3600}
    _, out, _ = run_cli(capsys, "cache", "stats", "--cache-dir", str(d))
    assert "tenant alice: TTL 1h" in out
    from engine.kvcache.disk.store import DiskPrefixStore

    expires = {e.tenant: e.expires - e.created for e in DiskPrefixStore(d).entries()}
    assert expires == {"alice": 3600, "bob": 24 * 3600}  # the cap applies to older entries
    code, out, _ = run_cli(capsys, "cache", "ttl", "--tenant", "alice", "--clear",
                           "--cache-dir", str(d))
    assert code == 0 and "TTL the default" in out
    _, out, _ = run_cli(capsys, "cache", "ttl", "--cache-dir", str(d))
    assert "no tenant TTLs" in out


def test_a_foreign_directory_is_reported_once_and_left_alone(tmp_path, capsys):
    d = tmp_path / "shared"
    fill(d, tenant_blocks("alice", 0))
    os.chmod(d, 0o1777)
    before = sorted(p for p in d.rglob("*"))
    code, out, err = run_cli(capsys, "cache", "stats", "--json", "--cache-dir", str(d))
    assert code == 0 and err.count("kvchat: warning: disk cache off") == 1
    assert json.loads(out)["degraded"].startswith("disk cache off")
    for cmd in (["purge", "--all"], ["ttl", "--tenant", "a", "60"]):
        code, _, err = run_cli(capsys, "cache", *cmd, "--cache-dir", str(d))
        assert_one_line_error(code, err, "nothing changed: disk cache off")
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o1777
    assert sorted(p for p in d.rglob("*")) == before


@pytest.mark.parametrize("fails", [False, True])
def test_verify_removes_its_temporary_store(tmp_path, capsys, monkeypatch, fails):
    from app import cache_cli
    from engine.errors import KVChatError

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    used = []

    def fake_verify(args, prompt, cache_dir, *, temporary):
        used.append(cache_dir)
        assert temporary and os.path.isdir(cache_dir)
        (Path(cache_dir) / "big").write_bytes(b"x" * 1000)
        if fails:
            raise KVChatError("the fresh process failed")
        return 0

    monkeypatch.setattr(cache_cli, "_verify", fake_verify)
    code, _, _ = run_cli(capsys, "cache", "verify")
    assert code == (2 if fails else 0) and used
    assert list(tmp_path.iterdir()) == []  # nothing left behind, even after a failure
