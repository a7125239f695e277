"""Private directories and files: exact modes whatever the umask; foreign dirs untouched."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from engine.paths import TEMP_MARK, is_private, private_dir, read_private, write_private


@pytest.fixture
def umask():
    """Set the process umask for one test and restore it afterwards."""
    old = os.umask(0o022)
    os.umask(old)
    yield os.umask
    os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.mark.parametrize("mask", [0o000, 0o077, 0o277])
def test_private_dir_creates_each_level_0700(tmp_path, umask, mask):
    umask(mask)
    leaf = private_dir(tmp_path / "a" / "b" / "c")
    assert leaf.is_dir()
    assert [mode(p) for p in (tmp_path / "a", tmp_path / "a/b", leaf)] == [0o700] * 3


def test_private_dir_keeps_a_foreign_sticky_dir(tmp_path, umask):
    umask(0)
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    loose = tmp_path / "loose"
    loose.mkdir()
    os.chmod(loose, 0o755)
    assert private_dir(shared) == shared
    assert stat.S_IMODE(shared.stat().st_mode) == 0o1777  # sticky bit kept
    private_dir(shared / "ours")
    assert stat.S_IMODE(shared.stat().st_mode) == 0o1777
    assert mode(shared / "ours") == 0o700
    private_dir(loose)
    assert mode(loose) == 0o755


def test_private_dir_refuses_a_file_in_the_way(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(OSError):
        private_dir(tmp_path / "f")
    with pytest.raises(OSError):
        private_dir(tmp_path / "f" / "sub")


@pytest.mark.parametrize("mask", [0o000, 0o077, 0o777])
def test_write_private_is_0600_whatever_the_umask(tmp_path, umask, mask):
    umask(mask)
    path = write_private(tmp_path / "f.json", b"one")
    assert mode(path) == 0o600 and path.read_bytes() == b"one"
    os.chmod(path, 0o666)  # an old loose file is replaced, not reused
    write_private(path, b"two")
    assert mode(path) == 0o600 and path.read_bytes() == b"two"
    assert [p.name for p in tmp_path.iterdir()] == ["f.json"]


def test_write_private_replaces_a_symlink_not_its_target(tmp_path):
    target = tmp_path / "target"
    target.write_text("keep")
    link = tmp_path / "link"
    link.symlink_to(target)
    write_private(link, b"new")
    assert target.read_text() == "keep"
    assert not link.is_symlink() and link.read_bytes() == b"new"


def test_write_private_cleans_up_on_failure(tmp_path):
    with pytest.raises(TypeError):
        write_private(tmp_path / "f", "not bytes")  # type: ignore[arg-type]
    assert not [p for p in tmp_path.iterdir() if TEMP_MARK in p.name]


def test_read_private_trusts_only_private_regular_files(tmp_path, monkeypatch):
    path = write_private(tmp_path / "memo", b"data")
    assert read_private(path) == b"data"
    assert is_private(os.lstat(path))
    link = tmp_path / "link"
    link.symlink_to(path)
    assert read_private(link) is None  # never through a symlink
    assert read_private(tmp_path / "missing") is None
    for loose in (0o620, 0o602, 0o666):
        os.chmod(path, loose)
        assert read_private(path) is None
    os.chmod(path, 0o644)  # readable by others is fine: only writers could forge it
    assert read_private(path) == b"data"
    uid = os.geteuid()
    monkeypatch.setattr(os, "geteuid", lambda: uid + 1)  # as if another user owned it
    assert read_private(path) is None
    assert not is_private(os.lstat(tmp_path), kind=stat.S_IFDIR)
