"""Disk prefix store: one file per KV block, named by its chained hash, under a 0700 directory.

Entries (format in `disk_entry`) live at ``<root>/<hex[:2]>/<hex>.kvb``, mode 0600. Writes are
atomic (O_EXCL temp file, fsync, rename, directory fsync): a crash leaves a complete entry or a
stray temp file, never a torn entry under a real name. Reads verify everything; an entry that
fails any check is a miss, is deleted and is counted by reason.

Cached K/V is user data: nothing is served past its expiry, and a byte budget is enforced in
LRU order at start-up and after every write. "Last used" is kept in the file's mtime so LRU
order survives restarts without a separate index file (atime is often disabled).
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from engine.kvcache import disk_entry
from engine.kvcache.disk_entry import EntryError, EntryHeader
from engine.kvcache.prefix_key import HASH_SIZE, CacheSalt, chain_hash
from engine.paths import cache_root, private_dir

_ENTRY_NAME = re.compile(r"[0-9a-f]{64}\.kvb")
_SHARD_NAME = re.compile(r"[0-9a-f]{2}")
# A younger temp file may be another process's write in flight: leave it alone.
TEMP_GRACE_S = 60.0


@dataclass(slots=True)
class EntryInfo:
    """One stored block as `DiskPrefixStore.entries` lists it (token count, not the ids)."""

    hash: str
    tenant: str
    permission_version: int
    model: str
    tokens: int
    bytes: int
    created: float
    expires: float
    last_used: float


@dataclass(slots=True)
class StoreStats:
    """Counters since this store object was opened, plus its current size."""

    entries: int = 0
    bytes: int = 0
    budget_bytes: int = 0
    hits: int = 0
    misses: int = 0
    writes: int = 0
    write_errors: int = 0
    dropped_writes: int = 0
    evictions: int = 0  # deleted to stay within the byte budget
    expired_removed: int = 0
    misses_by_reason: dict[str, int] = field(default_factory=dict)
    removed_by_reason: dict[str, int] = field(default_factory=dict)  # every file deletion
    pending_writes: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(slots=True)
class _Entry:
    size: int
    last_used: float
    header: EntryHeader


class DiskPrefixStore:
    """A crash-safe, budgeted, expiring store of KV blocks keyed by `prefix_key.chain_hash`.

    Args:
        root (Path, optional): the store's directory. Default: ``cache_root() / "prefix"``.
        budget_bytes (int): total file bytes kept; least recently used entries go first.
        default_ttl_s (float): lifetime of an entry. Default: 24 h.
        tenant_ttl_s (dict[str, float], optional): per-tenant lifetimes overriding the default.
        max_pending (int): bound of the background write queue (each item holds a block).
        clock (Callable[[], float]): unix time for created / expires / last used.
    """

    def __init__(
        self,
        root: Path | None = None,
        *,
        budget_bytes: int = 2 << 30,
        default_ttl_s: float = 24 * 3600,
        tenant_ttl_s: dict[str, float] | None = None,
        max_pending: int = 64,
        clock: Callable[[], float] = time.time,
    ):
        self.root = private_dir(Path(root) if root is not None else cache_root() / "prefix")
        self.budget_bytes = budget_bytes
        self.default_ttl_s = default_ttl_s
        self.tenant_ttl_s = dict(tenant_ttl_s or {})
        self._clock = clock
        self._lock = threading.Lock()  # index, counters; also held for renames and deletions
        self._idle = threading.Condition(self._lock)  # a queued write finished
        self._index: dict[bytes, _Entry] = {}
        self._bytes = 0
        self._writing: set[bytes] = set()
        self._stats = StoreStats(budget_bytes=budget_bytes)
        self._misses: Counter[str] = Counter()
        self._removed: Counter[str] = Counter()
        self._queue: queue.Queue = queue.Queue(max_pending)
        self._pending = 0
        self._writer: threading.Thread | None = None
        self._closed = False
        now = self._clock()
        for p in self._shard_files():
            if _ENTRY_NAME.fullmatch(p.name) and p.is_file(follow_symlinks=False):
                self._scan_entry(Path(p.path), now)
            else:
                self._remove_if_stale_temp(p)
        with self._lock:
            self._enforce_budget_locked()

    def get(
        self, salt: CacheSalt, block_hash: bytes, token_ids: Sequence[int]
    ) -> list[np.ndarray] | None:
        """The block's arrays (``list[np.ndarray]``, uint16 for bfloat16), or None on a miss.

        Verifies magic, format version, checksum, header, the whole salt (model, tokenizer,
        prompt version, position, KV format, block size, tenant, permission version), block
        hash, token ids, expiry and payload sizes. A failing entry is deleted and counted in
        ``stats().misses_by_reason``. Never raises on bad file content.
        """
        path = self._path(block_hash)
        try:
            data, st = disk_entry.read_file(path, max(self.budget_bytes, 1 << 20))
        except FileNotFoundError:
            return self._miss(block_hash, "absent")
        except OSError:
            return self._miss(block_hash, "io_error")
        try:
            if data is None:
                raise EntryError("corrupt", "size")
            header, arrays = disk_entry.decode_entry(data)
            self._verify(header, salt, block_hash, token_ids)
        except EntryError as e:
            return self._miss(block_hash, e.reason, path, st.st_ino)
        now = self._clock()
        with self._lock:
            self._stats.hits += 1
            entry = self._index.get(block_hash)
            if entry is None:  # another process wrote it after our scan
                self._add_locked(block_hash, _Entry(st.st_size, now, header))
            else:
                entry.last_used = now
            with contextlib.suppress(OSError):
                os.utime(path, (now, now))  # persists LRU order across restarts
        return arrays

    def contains(self, block_hash: bytes) -> bool:
        """Whether the index holds ``block_hash`` (no disk access, no verification)."""
        with self._lock:
            return block_hash in self._index

    def put(
        self,
        salt: CacheSalt,
        block_hash: bytes,
        parent_hash: bytes,
        token_ids: Sequence[int],
        arrays: Sequence[np.ndarray],
        ttl_s: float | None = None,
    ) -> bool:
        """Write one block now; True if written.

        False when the block is already stored or being written, alone exceeds the budget,
        has a TTL that is not positive, or on an I/O error (counted in ``write_errors``).
        ``ttl_s`` defaults to the tenant's TTL, else ``default_ttl_s``.

        Raises:
            ValueError: ``block_hash != chain_hash(parent_hash, token_ids)``, a token count
                other than ``salt.block_size``, or arrays not numpy ``(heads, block_size,
                dim)`` float32 / float16 / uint16 (bfloat16 bits).
        """
        header = self._make_header(salt, block_hash, parent_hash, token_ids, arrays, ttl_s)
        size = header.file_size()
        if header.expires <= header.created or size > self.budget_bytes:
            return False
        with self._lock:
            if block_hash in self._index or block_hash in self._writing:
                return False
            self._writing.add(block_hash)
        path, tmp = self._path(block_hash), None
        try:
            if not path.parent.is_dir():
                private_dir(path.parent)
            tmp = disk_entry.write_temp(path, header, arrays)
            with self._lock:
                os.replace(tmp, path)
                self._add_locked(header.block_hash, _Entry(size, header.created, header))
                self._stats.writes += 1
                self._enforce_budget_locked()
        except OSError:
            with self._lock:
                self._stats.write_errors += 1
            if tmp is not None:
                tmp.unlink(missing_ok=True)
            return False
        finally:
            with self._lock:
                self._writing.discard(block_hash)
        disk_entry.fsync_dir(path.parent)  # makes the rename itself durable
        return True

    def put_async(
        self,
        salt: CacheSalt,
        block_hash: bytes,
        parent_hash: bytes,
        token_ids: Sequence[int],
        arrays: Sequence[np.ndarray],
        ttl_s: float | None = None,
    ) -> bool:
        """Queue a `put` for the background writer thread; never blocks. True if queued.

        ``arrays`` must be numpy copies the caller no longer touches. A full queue or a closed
        store drops the write (counted in ``dropped_writes``); a stored block is skipped.
        """
        if not all(isinstance(a, np.ndarray) for a in arrays):
            raise TypeError("put_async needs numpy copies, not views of the KV pool")
        with self._lock:
            if block_hash in self._index:
                return False
            if self._closed:
                self._stats.dropped_writes += 1
                return False
            if self._writer is None:
                self._writer = threading.Thread(
                    target=self._run_writer, name="kvchat-prefix-writer", daemon=True
                )
                self._writer.start()
            self._pending += 1
        try:
            self._queue.put_nowait((salt, block_hash, parent_hash, token_ids, arrays, ttl_s))
        except queue.Full:
            self._write_done(dropped=True)
            return False
        return True

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write is done; False if ``timeout`` ran out first."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    def close(self) -> None:
        """Drain the queue and stop the writer; later `put_async` calls are dropped."""
        with self._lock:
            writer, self._closed = (None if self._closed else self._writer), True
        if writer is not None:
            self._queue.put(None)
            writer.join()

    def __enter__(self) -> DiskPrefixStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def sweep(self) -> int:
        """Delete expired entries, enforce the budget, remove temp files older than a minute.

        Returns the number of entries deleted (temp files not counted).
        """
        removed = self.purge(expired_only=True)
        with self._lock:
            removed += self._enforce_budget_locked()
        for p in self._shard_files():
            self._remove_if_stale_temp(p)
        return removed

    def purge(
        self,
        tenant: str | None = None,
        model: str | None = None,
        expired_only: bool = False,
        all: bool = False,
        permission_below: int | None = None,
    ) -> int:
        """Delete the entries matching every given filter; returns how many.

        Args:
            tenant (str, optional): only this tenant's entries.
            model (str, optional): only entries whose model fingerprint starts with this.
            expired_only (bool): only entries past their expiry. Default: ``False``.
            all (bool): allow a purge without filters (everything). Default: ``False``.
            permission_below (int, optional): only entries with a lower permission version
                (what a permission bump made unreachable; combine with ``tenant``).

        Raises:
            ValueError: no filter given and ``all`` is False, so nothing is wiped by mistake.
        """
        filters = (tenant, model, permission_below)
        if not (all or expired_only or any(f is not None for f in filters)):
            raise ValueError("purge needs tenant, model, expired_only, permission_below or all")
        now = self._clock()
        with self._lock:
            doomed = [
                h
                for h, e in self._index.items()
                if (tenant is None or e.header.salt.tenant == tenant)
                and (model is None or e.header.salt.model_fingerprint.startswith(model))
                and (not expired_only or now >= e.header.expires)
                and (permission_below is None
                     or e.header.salt.permission_version < permission_below)
            ]
            for h in doomed:
                self._drop_locked(h, "expired" if expired_only else "purge")
        return len(doomed)

    def entries(self) -> list[EntryInfo]:
        """Every indexed entry, most recently used first."""
        with self._lock:
            items = sorted(self._index.items(), key=lambda kv: -kv[1].last_used)
        return [
            EntryInfo(
                hash=h.hex(),
                tenant=e.header.salt.tenant,
                permission_version=e.header.salt.permission_version,
                model=e.header.salt.model_fingerprint,
                tokens=len(e.header.token_ids),
                bytes=e.size,
                created=e.header.created,
                expires=e.header.expires,
                last_used=e.last_used,
            )
            for h, e in items
        ]

    def stats(self) -> StoreStats:
        """A snapshot of the counters and the current size."""
        with self._lock:
            return replace(
                self._stats,
                entries=len(self._index),
                bytes=self._bytes,
                pending_writes=self._pending,
                misses_by_reason=dict(self._misses),
                removed_by_reason=dict(self._removed),
            )

    # ---- internals ----------------------------------------------------------------------------

    def _path(self, block_hash: bytes) -> Path:
        name = bytes(block_hash).hex()
        return self.root / name[:2] / f"{name}.kvb"

    def _shard_files(self) -> Iterator[os.DirEntry]:
        """Everything inside the shard directories; other names under the root are not ours."""
        for shard in _scandir(self.root):
            if _SHARD_NAME.fullmatch(shard.name) and shard.is_dir(follow_symlinks=False):
                with contextlib.suppress(OSError):
                    os.chmod(shard.path, 0o700)
                yield from _scandir(shard.path)

    def _remove_if_stale_temp(self, p: os.DirEntry) -> None:
        # Real time, not self._clock: this compares against the filesystem's own mtime.
        with contextlib.suppress(OSError):
            if (
                p.name.endswith(disk_entry.TEMP_SUFFIX)
                and p.stat(follow_symlinks=False).st_mtime < time.time() - TEMP_GRACE_S
            ):
                with self._lock:
                    self._remove_file(Path(p.path), "temp")

    def _scan_entry(self, path: Path, now: float) -> None:
        """Index one entry from its header alone; delete it if bad or expired."""
        try:
            with open(path, "rb", opener=disk_entry.nofollow) as f:
                st = os.fstat(f.fileno())
                header = disk_entry.read_header(f, st.st_size)
            if header.block_hash.hex() != path.stem:
                raise EntryError("corrupt", "file name")
            reason = "expired" if now >= header.expires else None
        except EntryError as e:
            reason = e.reason
        except OSError:
            reason = "corrupt"  # unreadable: it could only ever be a miss
        with self._lock:
            if reason is not None:
                self._remove_file(path, reason)
            else:
                self._add_locked(header.block_hash, _Entry(st.st_size, st.st_mtime, header))

    def _verify(self, header: EntryHeader, salt, block_hash, token_ids) -> None:
        if header.salt != salt:
            raise EntryError("foreign")
        if header.block_hash != block_hash or len(header.token_ids) != salt.block_size:
            raise EntryError("corrupt", "block hash or size")
        if chain_hash(header.parent_hash, header.token_ids) != block_hash:
            raise EntryError("corrupt", "chain hash")
        if header.token_ids != [int(t) for t in token_ids]:
            raise EntryError("mismatch")
        if self._clock() >= header.expires:
            raise EntryError("expired")

    def _miss(self, block_hash, reason, path=None, inode=None) -> None:
        with self._lock:
            self._stats.misses += 1
            self._misses[reason] += 1
            if reason == "absent":
                self._pop_locked(block_hash)
            elif path is not None:
                # Delete only the file we judged: our writer may have replaced it since.
                with contextlib.suppress(OSError):
                    if os.stat(path, follow_symlinks=False).st_ino == inode:
                        self._drop_locked(block_hash, reason)
        return None

    def _make_header(self, salt, block_hash, parent_hash, token_ids, arrays, ttl_s):
        tokens = [int(t) for t in token_ids]
        if len(block_hash) != HASH_SIZE or chain_hash(parent_hash, tokens) != block_hash:
            raise ValueError("block_hash is not chain_hash(parent_hash, token_ids)")
        if len(tokens) != salt.block_size:
            raise ValueError(f"{len(tokens)} token ids for block size {salt.block_size}")
        if not arrays or any(
            not isinstance(a, np.ndarray) or a.ndim != 3 or a.shape[1] != salt.block_size
            for a in arrays
        ):
            raise ValueError("arrays must be numpy (kv_heads, block_size, head_dim)")
        if ttl_s is None:
            ttl_s = self.tenant_ttl_s.get(salt.tenant, self.default_ttl_s)
        now = self._clock()
        return EntryHeader(
            salt=salt,
            block_hash=bytes(block_hash),
            parent_hash=bytes(parent_hash),
            token_ids=tokens,
            created=now,
            expires=now + ttl_s,
            tensors=[(disk_entry.dtype_name(a), tuple(a.shape)) for a in arrays],
        )

    def _run_writer(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                self.put(*item)
            except Exception:  # a malformed block must not kill the writer
                with self._lock:
                    self._stats.write_errors += 1
            finally:
                self._write_done()

    def _write_done(self, dropped: bool = False) -> None:
        with self._idle:
            self._pending -= 1
            self._stats.dropped_writes += int(dropped)
            self._idle.notify_all()

    def _add_locked(self, block_hash: bytes, entry: _Entry) -> None:
        self._pop_locked(block_hash)
        self._index[block_hash] = entry
        self._bytes += entry.size

    def _pop_locked(self, block_hash: bytes) -> None:
        entry = self._index.pop(block_hash, None)
        if entry is not None:
            self._bytes -= entry.size

    def _drop_locked(self, block_hash: bytes, reason: str) -> None:
        self._pop_locked(block_hash)
        self._remove_file(self._path(block_hash), reason)

    def _remove_file(self, path: Path, reason: str) -> None:
        try:
            path.unlink()
        except OSError:  # already gone
            return
        self._removed[reason] += 1
        self._stats.expired_removed += int(reason == "expired")
        self._stats.evictions += int(reason == "budget")

    def _enforce_budget_locked(self) -> int:
        if self._bytes <= self.budget_bytes:
            return 0
        evicted = 0
        for h, _ in sorted(self._index.items(), key=lambda kv: kv[1].last_used):
            if self._bytes <= self.budget_bytes:
                break
            self._drop_locked(h, "budget")
            evicted += 1
        return evicted


def _scandir(path) -> list[os.DirEntry]:
    try:
        with os.scandir(path) as it:
            return list(it)
    except OSError:
        return []
