"""The entry files of the disk prefix store: read, judged, written and deleted within what the
store's root allows (`root.open_root`); shards that are symlinks or writable by others are
never used, and only files named like entries or kvchat temp files are ever deleted.

What kvchat never makes is cleared where it blocks the store for good (`EntryFiles.reclaim`):
a symlink at a shard's name is unlinked (never followed: what it points to is untouched) and
a directory at an entry's name in a private shard is removed (no link inside followed), so
a block, or the 1/256 of blocks of a shard, is not kept off disk forever (issue 33 item 13).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import stat
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from engine.kvcache.disk import entry
from engine.kvcache.disk.entry import EntryError, EntryHeader
from engine.kvcache.disk.root import (
    TEMP_NAME,
    checked_dir,
    fsync_dir,
    nofollow,
    open_root,
    scandir,
    write_temp,
)
from engine.kvcache.disk.spec import EntrySpec
from engine.kvcache.prefix_key import CacheSalt
from engine.paths import is_private

ENTRY_NAME = re.compile(r"[0-9a-f]{64}\.kvb")
SHARD_NAME = re.compile(r"[0-9a-f]{2}")
# A younger temp file may be another process's write in flight: leave it alone.
TEMP_GRACE_S = 60.0
# Errors that mean the directory or the disk takes no more writes, not that one entry is bad.
STOP_ERRNOS = frozenset(
    getattr(errno, name) for name in ("EROFS", "EACCES", "EPERM", "ENOSPC", "EDQUOT")
    if hasattr(errno, name)
)


class UnsafeDirError(OSError):
    """A shard directory that is a symlink or writable by others: never read or written."""


class EntryFiles:
    """The entry files under a store's root, ``<root>/<hex[:2]>/<hex>.kvb``, within what the
    root allows (`open_root`).

    Attributes:
        readable (bool): entries may be read.
        writable (bool): entries may be written; False for good once a write finds the
            directory read-only or full (`STOP_ERRNOS`).
        tidy (bool): files may be deleted and touched (the root was writable at open).
        degraded (str | None): the first reason for not reading or writing, one line.
    """

    def __init__(self, root: Path):
        access = open_root(root)
        self.root, self.readable, self.writable = root, access.readable, access.writable
        self.tidy, self.degraded = access.writable, access.warning

    def path(self, block_hash: bytes) -> Path:
        name = bytes(block_hash).hex()
        return self.root / name[:2] / f"{name}.kvb"

    def read(self, block_hash: bytes, max_bytes: int) -> tuple[bytearray | None, os.stat_result]:
        """The entry's bytes (None if over ``max_bytes``) and stat; never follows a link.

        Raises:
            FileNotFoundError: absent.
            UnsafeDirError: its shard is a symlink or writable by others.
            OSError: unreadable (or, say, a directory sits at its path).
        """
        path = self.path(block_hash)
        if not checked_dir(path.parent):
            raise UnsafeDirError(f"{path.parent} is not a private directory")
        with open(path, "rb", opener=_nofollow_nonblock) as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise OSError(f"{path} is not a regular file")
            if st.st_size > max_bytes:
                return None, st  # no valid entry is this big: don't read garbage into memory
            data = bytearray(st.st_size)
            return (data if f.readinto(data) == st.st_size else None), st

    def read_checked(self, block_hash: bytes, max_bytes: int) -> tuple:
        """`read` and `entry.checksum_ok` of what was read, as ``(data, stat, ok)``, or the
        OSError ``read`` raised as ``(error, None, False)``: the I/O and hashing a reader
        thread does ahead of `load` (both run without the GIL). Judges nothing."""
        try:
            data, st = self.read(block_hash, max_bytes)
        except OSError as e:
            return e, None, False
        return data, st, data is not None and entry.checksum_ok(data)

    def load(self, block_hash: bytes, max_bytes: int, salt: CacheSalt, token_ids: Sequence[int],
             expect: EntrySpec | None, read: tuple | None = None
             ) -> tuple[EntryHeader, list[np.ndarray], os.stat_result]:
        """Read and check an entry: the whole file (`entry.decode_entry`), then the
        block asked for (`entry.check_entry`); all but expiry. ``read`` is `read_checked`
        of this block done ahead, if it was.

        Raises:
            EntryError: the miss reason. With ``inode`` None nothing was judged ("disabled",
                "absent", "unsafe_dir", "io_error"); else the file failed (or, "error",
                surprised) a check.
        """
        if not self.readable:
            raise EntryError("disabled")
        data, st, ok = read if read is not None else self.read_checked(block_hash, max_bytes)
        if isinstance(data, OSError):
            reason = ("absent" if isinstance(data, FileNotFoundError) else "unsafe_dir"
                      if isinstance(data, UnsafeDirError) else "io_error")  # io: a directory..
            raise EntryError(reason)
        try:
            if data is None:
                raise EntryError("corrupt", "size")
            header, arrays = entry.decode_entry(data, checked=ok)
            entry.check_entry(header, salt, block_hash, token_ids, expect)
        except EntryError as e:
            e.inode = st.st_ino
            raise
        except Exception as e:  # unforeseen content: delete it, or every later run trips on it
            raise EntryError("error", repr(e), st.st_ino) from None
        return header, arrays, st

    def write_temp(self, header: EntryHeader, arrays: Sequence[np.ndarray]) -> Path:
        """Write the entry to a temp file in its shard (made 0700 if missing); see `commit`.

        Raises:
            OSError: UnsafeDirError for a symlinked or loose shard; an error in `STOP_ERRNOS`
                also stops every later write and sets ``degraded``.
        """
        path = self.path(header.block_hash)
        try:
            self._make_shard(path.parent)
            return write_temp(path, lambda f: entry.write_entry(f, header, arrays),
                              header.created)
        except OSError as e:
            if e.errno in STOP_ERRNOS:  # read-only, full: every later write would fail too
                self.writable = False
                msg = f"disk cache writes stopped: {path.parent}: {e.strerror}"
                self.degraded = self.degraded or msg
            raise

    def _make_shard(self, shard: Path) -> None:
        for _ in range(2):
            try:
                os.mkdir(shard, 0o700)
                os.chmod(shard, 0o700)  # ours: exact mode whatever the umask
                return
            except FileExistsError:
                if checked_dir(shard):
                    return
                if not self.reclaim(shard, stat.S_IFLNK):  # a symlink goes; else refuse
                    break
        raise UnsafeDirError(f"{shard} is not a private directory")

    def commit(self, tmp: Path, block_hash: bytes) -> None:
        """Rename a `write_temp` file into place (clearing a directory that sits at the
        entry's path, `reclaim`); on failure it is removed.

        Raises:
            OSError: the rename failed (a directory that could not be cleared, ...).
        """
        path = self.path(block_hash)
        try:
            try:
                os.replace(tmp, path)
            except OSError:
                if not self.reclaim(path, stat.S_IFDIR):
                    raise
                os.replace(tmp, path)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise

    def reclaim(self, path: Path, kind: int) -> bool:
        """Clear what blocks the store at ``path``, only if it is ``kind``: a symlink at a
        shard's name (`stat.S_IFLNK`: the link itself is unlinked, its target untouched) or
        a directory at an entry's name in a private shard (`stat.S_IFDIR`: removed with
        what it holds, never following a link, where the platform's `shutil.rmtree` resists
        symlink attacks). Nothing in a root that may not be tidied. True if cleared."""
        if not self.tidy:
            return False
        try:
            st = os.lstat(path)
            if kind == stat.S_IFLNK and stat.S_ISLNK(st.st_mode):
                os.unlink(path)
            elif (kind == stat.S_IFDIR and stat.S_ISDIR(st.st_mode)
                  and shutil.rmtree.avoids_symlink_attacks and checked_dir(path.parent)):
                shutil.rmtree(path)
            else:
                return False
        except OSError:
            return False
        return True

    def clear_blockers(self, block_hash: bytes) -> bool:
        """`reclaim` a symlinked shard or a directory at the entry of ``block_hash`` (a read
        found one); True if one was cleared."""
        path = self.path(block_hash)
        return self.reclaim(path.parent, stat.S_IFLNK) or self.reclaim(path, stat.S_IFDIR)

    def touch(self, block_hash: bytes, t: float) -> None:
        """Set the entry's mtime (its "last used"), best effort; not in a read-only root."""
        if self.tidy:
            with contextlib.suppress(OSError):
                os.utime(self.path(block_hash), (t, t), follow_symlinks=False)

    def sync(self, block_hash: bytes) -> None:
        """Make a `commit` durable (fsync the shard directory)."""
        fsync_dir(self.path(block_hash).parent)

    def remove(self, path: Path, inode: int | None = None) -> bool:
        """Delete a file found by `scan` or named by `path` (only if it is still ``inode``,
        when given); False if gone, another file, or not allowed in a read-only root."""
        if not self.tidy:
            return False
        try:
            if inode is not None and os.lstat(path).st_ino != inode:
                return False
            path.unlink()
        except OSError:
            return False
        return True

    def scan(self, entries: bool = True) -> Iterator[tuple[Path, EntryHeader | None,
                                                       os.stat_result | None, str | None]]:
        """Walk the private shards (symlinked or loose ones are skipped), yielding
        ``(path, header, stat, None)`` for an entry whose header passes `check_structure`
        and ``(path, None, None, reason)`` for a file to delete: an entry-named file that
        fails, or a kvchat temp file (in a shard or the root) older than `TEMP_GRACE_S`.
        Nothing else is yielded.
        """
        top = scandir(self.root) if self.readable else []
        for p in top + [p for d in top if _is_shard(d) for p in scandir(d.path)]:
            try:
                if not p.is_file(follow_symlinks=False):
                    continue
                if ENTRY_NAME.fullmatch(p.name) and p.path != os.path.join(self.root, p.name):
                    if entries:
                        yield _scan_entry(Path(p.path))
                # Real time: this compares against the filesystem's own mtime.
                elif (TEMP_NAME.fullmatch(p.name)
                      and p.stat(follow_symlinks=False).st_mtime < time.time() - TEMP_GRACE_S):
                    yield Path(p.path), None, None, "temp"
            except OSError:
                continue


def _nofollow_nonblock(path, flags: int) -> int:
    # A FIFO planted at an entry's path must not hang the reader in open().
    return nofollow(path, flags | getattr(os, "O_NONBLOCK", 0))


def _is_shard(d: os.DirEntry) -> bool:
    try:
        return bool(SHARD_NAME.fullmatch(d.name)) and is_private(
            d.stat(follow_symlinks=False), kind=stat.S_IFDIR)
    except OSError:
        return False


def _scan_entry(path: Path) -> tuple[Path, EntryHeader | None, os.stat_result | None, str | None]:
    try:
        with open(path, "rb", opener=_nofollow_nonblock) as f:
            st = os.fstat(f.fileno())
            header = entry.read_header(f, st.st_size)
        if header.block_hash.hex() != path.stem:
            raise EntryError("corrupt", "file name")
        entry.check_structure(header)
    except EntryError as e:
        return path, None, None, e.reason
    except Exception:  # unreadable or unforeseen: it could only ever be a miss
        return path, None, None, "corrupt"
    return path, header, st, None
