"""Where kvchat keeps its files, and how it creates them privately.

Everything kvchat writes under its cache root (converted models, fingerprints,
the BLAS shim, conversations, settings, the prefix store) is user data or code it
loads, so directories are created 0700 and files 0600 whatever the umask. Only
directories kvchat creates itself are tightened: a foreign directory (say a
1777 ``/tmp``) keeps its mode and sticky bit.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import stat
from pathlib import Path

TEMP_MARK = ".kvchat-tmp-"
"""Part of every temp file name kvchat writes, so nothing else is ever taken for one."""

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def cache_root() -> Path:
    """The user cache directory for kvchat: ``$KVCHAT_HOME`` or ``~/.cache/kvchat``."""
    env = os.environ.get("KVCHAT_HOME")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "kvchat"


def private_dir(path: Path) -> Path:
    """Create ``path`` and its missing parents, each created level 0700; return it.

    Directories that already exist are left exactly as they are (never chmodded):
    kvchat tightens only what it created itself.
    """
    path = Path(path)
    missing: list[Path] = []
    level = path
    while not level.is_dir():
        missing.append(level)
        if level.parent == level:
            break
        level = level.parent
    for level in reversed(missing):
        try:
            os.mkdir(level, 0o700)
        except FileExistsError:
            if level.is_dir():
                continue  # created meanwhile by someone else: not ours to chmod
            raise
        os.chmod(level, 0o700)  # mkdir's mode is masked by the umask; make it exact
    return path


def is_private(st: os.stat_result, *, kind: int = stat.S_IFREG) -> bool:
    """True when ``st`` (from ``lstat``/``fstat``) is of ``kind``, ours, and not writable
    by group or others: the test for anything kvchat reads back and trusts."""
    return (
        stat.S_IFMT(st.st_mode) == kind
        and st.st_uid == os.geteuid()
        and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    )


def is_private_dir(path: Path) -> bool:
    """True when ``path`` is a directory (not a symlink to one) that `is_private` accepts."""
    try:
        return is_private(os.lstat(path), kind=stat.S_IFDIR)
    except OSError:
        return False


def is_trusted_file(path: Path) -> bool:
    """True when ``path`` is a private regular file of ours (not a symlink) in a private
    directory of ours: the rule for code kvchat loads into its process, as anyone who
    could write either could run code in every kvchat process."""
    try:
        return is_private_dir(path.parent) and is_private(os.lstat(path))
    except OSError:
        return False


def is_private_tree(path: Path, *, required: str | None = None) -> bool:
    """True when ``path`` is a private directory of ours holding only private regular
    files (no subdirectories, no symlinks), ``required`` among them when given."""
    try:
        if not is_private(os.lstat(path), kind=stat.S_IFDIR):
            return False
        entries = list(os.scandir(path))
        return (required is None or any(e.name == required for e in entries)) and all(
            is_private(e.stat(follow_symlinks=False)) for e in entries
        )
    except OSError:
        return False


def remove_own(path: Path) -> None:
    """Remove a file, symlink or directory tree that kvchat wrote; nothing if missing.

    A directory is first renamed aside, so ``path`` is never seen half-deleted.

    Raises:
        PermissionError: ``path`` belongs to another user (kvchat deletes only what it wrote).
    """
    path = Path(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if st.st_uid != os.geteuid():
        raise PermissionError(f"{path} belongs to another user; not removing it")
    if stat.S_ISDIR(st.st_mode):
        aside = temp_path(path)
        os.rename(path, aside)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.unlink(path)


def temp_path(path: Path) -> Path:
    """A fresh kvchat-named temp path next to ``path`` (same directory, so rename is atomic)."""
    path = Path(path)
    return path.with_name(f".{path.name}{TEMP_MARK}{os.getpid()}-{secrets.token_hex(4)}")


def write_private(path: Path, data: bytes, *, mode: int = 0o600) -> Path:
    """Write ``data`` to ``path`` atomically with exactly ``mode`` (0600), whatever the umask.

    The bytes go to a new kvchat-named temp file in the same directory (created with
    O_EXCL and O_NOFOLLOW, so no existing file or symlink is reused), are fsynced, and the
    temp file is renamed over ``path``. The parent directory must exist (see `private_dir`).
    A failure removes the temp file and re-raises.
    """
    path = Path(path)
    tmp = temp_path(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, mode)
    try:
        try:
            os.fchmod(fd, mode)  # the umask may have narrowed (or a caller widened) it
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def read_private(path: Path) -> bytes | None:
    """The bytes of ``path`` if it is a private regular file of ours, else None.

    Opened without following symlinks and checked on the open descriptor, so the file
    that is checked is the file that is read. Missing or unreadable files give None.
    """
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _CLOEXEC)
    except OSError:
        return None
    try:
        if not is_private(os.fstat(fd)):
            return None
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read()
    except OSError:
        return None
    finally:
        os.close(fd)
