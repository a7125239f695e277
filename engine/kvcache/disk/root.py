"""The disk store's root directory: judged before use, created private, written atomically.

Anyone who can write into a store directory can plant entries (a checksum is no signature), so
entries are read only from directories owned by the user (or root) and writable by no one else,
and written only into real directories, never through a symlink. kvchat makes the directories
it creates 0700 and leaves the modes of existing ones alone (`paths.private_dir`). Temp files
carry kvchat's mark (`paths.temp_path`): clean-up never touches another program's files.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from engine.paths import TEMP_MARK, is_private, private_dir, temp_path

TTL_FILE = "tenant-ttl.json"  # per-tenant TTLs (`index.TenantTTLs`), beside the entries
# Temp files of entries and of the TTL file (`paths.temp_path`), and the entry temp name
# kvchat used before: the only files besides entries that the store ever deletes.
TEMP_NAME = re.compile(
    rf"\.(?:[0-9a-f]{{64}}\.kvb|{re.escape(TTL_FILE)}){re.escape(TEMP_MARK)}[0-9]+-[0-9a-f]+"
    r"|\.[0-9a-f]{64}\.[0-9a-f]{12}\.tmp"
)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


@dataclass(frozen=True, slots=True)
class RootAccess:
    """What the store may do in its root; ``warning`` is one line for the user, or None."""

    readable: bool
    writable: bool
    warning: str | None = None


def open_root(path: Path) -> RootAccess:
    """Create ``path`` if missing (0700) and judge it: not a directory, not creatable,
    another user's, or group- or world-writable: not used at all (others could plant entries
    there); a symlink (to a directory passing those checks) or not writable: read only.
    """
    try:
        private_dir(path)
        link, st = os.lstat(path), os.stat(path)
    except OSError as e:
        return RootAccess(False, False, f"disk cache off: cannot use {path}: {e.strerror or e}")
    if not stat.S_ISDIR(st.st_mode):
        return RootAccess(False, False, f"disk cache off: {path} is not a directory")
    if not is_private(st, kind=stat.S_IFDIR):
        why = f"mode {stat.S_IMODE(st.st_mode):o}, owner uid {st.st_uid}"
        return RootAccess(False, False, f"disk cache off: {path} is not private ({why}); "
                                        "use a directory only you can write (chmod 700)")
    if stat.S_ISLNK(link.st_mode):
        return RootAccess(True, False, f"disk cache read-only: {path} is a symlink "
                                       "(kvchat writes only into a real directory)")
    if not os.access(path, os.W_OK | os.X_OK):
        return RootAccess(True, False, f"disk cache read-only: {path} is not writable")
    return RootAccess(True, True)


def checked_dir(path: Path) -> bool:
    """Whether ``path`` is a private real directory of ours (a symlink is not).

    Raises:
        FileNotFoundError: nothing is there.
    """
    return is_private(os.lstat(path), kind=stat.S_IFDIR)


def scandir(path) -> list[os.DirEntry]:
    """The entries of a directory; [] if it cannot be listed."""
    try:
        with os.scandir(path) as it:
            return list(it)
    except OSError:
        return []


def write_temp(path: Path, write: Callable[[BinaryIO], None], mtime: float | None = None) -> Path:
    """Write a fresh kvchat temp file beside ``path`` with ``write(f)``, durable and mode 0600.

    Streams (an entry is megabytes: no copy into one bytes object, as `paths.write_private`
    would need). The caller renames it into place and fsyncs the directory; until then a crash
    leaves only a temp file, which readers never open. ``mtime`` sets its modification time.
    """
    tmp = temp_path(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600)
    try:
        with open(fd, "wb") as f:
            os.fchmod(fd, 0o600)  # exact mode whatever the umask
            write(f)
            f.flush()
            os.fsync(fd)
        if mtime is not None:
            os.utime(tmp, (mtime, mtime))
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def nofollow(path, flags: int) -> int:
    """`open` opener refusing symlinks."""
    return os.open(path, flags | _NOFOLLOW)


def fsync_dir(path: Path) -> None:
    """Make renames in ``path`` durable; best effort (some filesystems refuse)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)
