"""The disk prefix store's API: get, put (now or in the background), sweep, purge, TTLs, stats.

What the store is and what it promises: the package docstring (`engine.kvcache.disk`). Here
one lock guards the record of entries (`catalog.Catalog`) and the blocks being written.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

from engine.errors import KVChatError
from engine.kvcache.disk import entry
from engine.kvcache.disk.catalog import Catalog
from engine.kvcache.disk.entry import EntryError
from engine.kvcache.disk.files import TEMP_GRACE_S, EntryFiles
from engine.kvcache.disk.index import EntryInfo, StoreStats, TenantTTLs
from engine.kvcache.disk.root import TTL_FILE
from engine.kvcache.disk.spec import EntrySpec
from engine.kvcache.disk.writer import BackgroundWriter
from engine.kvcache.prefix_key import CacheSalt
from engine.paths import cache_root

__all__ = ["TEMP_GRACE_S", "TTL_FILE", "DiskPrefixStore", "EntryInfo", "EntrySpec", "StoreStats"]


class DiskPrefixStore:
    """A crash-safe, budgeted, expiring store of KV blocks keyed by `prefix_key.chain_hash`.

    Opening never fails on the directory: one that cannot be used safely leaves the store
    read-only or off (`root.open_root`), and ``degraded`` says why.

    Args:
        root (Path, optional): the store's directory. Default: ``cache_root() / "prefix"``.
        budget_bytes (int): total file bytes kept; least recently used entries go first.
        default_ttl_s (float): lifetime of an entry. Default: 24 h.
        tenant_ttl_s (dict[str, float], optional): per-tenant lifetimes; against one saved
            in the directory (`set_tenant_ttl`) the shorter wins.
        max_pending (int): bound of the background write queue (each item holds a block).
        clock (Callable[[], float]): unix time for created / expires / last used.
        expire_at_open (bool): delete expired entries when opening; False indexes them so
            that ``purge(expired_only=True)`` counts them. Default: ``True``.
        hold (Callable[[], bool], optional): queued writes wait while it is True (the
            engine computing), up to `writer.MAX_HOLD_S` each (`BackgroundWriter`).
    """

    def __init__(self, root: Path | None = None, *, budget_bytes: int = 2 << 30,
                 default_ttl_s: float = 24 * 3600, tenant_ttl_s: dict[str, float] | None = None,
                 max_pending: int = 64, clock: Callable[[], float] = time.time,
                 expire_at_open: bool = True, hold: Callable[[], bool] | None = None):
        self.files = EntryFiles(Path(root) if root is not None else cache_root() / "prefix")
        self.root = self.files.root
        self.budget_bytes = budget_bytes
        self.ttls = TenantTTLs(self.root / TTL_FILE if self.files.readable else None,
                               default_ttl_s, tenant_ttl_s)
        self._clock = clock
        self._lock = threading.Lock()  # catalog, writing; also held for renames and deletions
        self._catalog = Catalog(self.files, budget_bytes)
        self._writing: set[bytes] = set()  # blocks a `put` is writing now
        self._writer = BackgroundWriter(self.put, max_pending, hold=hold)
        self._reader: ThreadPoolExecutor | None = None  # `prefetch`, started on first use
        now = self._clock() if expire_at_open else -math.inf
        with self._lock:
            self._catalog.load(self.files.scan(), self.ttls.expiry, now)

    @property
    def degraded(self) -> str | None:
        """Why entries are not read or not written (one line, set once), or None."""
        return self.files.degraded

    @property
    def state(self) -> str:
        """"on" (entries read and written), "read-only" (served, none written: a read-only,
        full or symlinked directory) or "off" (a directory that cannot be used); ``degraded``
        says why."""
        return "on" if self.files.writable else "read-only" if self.files.readable else "off"

    @property
    def writable(self) -> bool:
        """Whether new entries are written (False: a read-only, full or foreign directory)."""
        return self.files.writable

    def get(self, salt: CacheSalt, block_hash: bytes, token_ids: Sequence[int], *,
            expect: EntrySpec | None = None,
            prefetched: Future | None = None) -> list[np.ndarray] | None:
        """The block's arrays (``list[np.ndarray]`` in `EntrySpec.tensors` order), or None.

        Verifies the whole file (`entry.decode_entry`), then salt, block hash, token ids,
        format and tensors (`entry.check_entry`; with ``expect``, only an entry of exactly
        that spec is served), then expiry. A failing entry is deleted and counted in
        ``stats().misses_by_reason``. Never raises: anything unforeseen is a miss ("error").
        ``prefetched`` is this block's `prefetch`: its bytes and checksum, judged here.
        """
        try:
            read = prefetched.result() if prefetched is not None else None
            return self._read(salt, block_hash, token_ids, expect, read)
        except Exception:  # a surprise must cost a miss, never the request (or its neighbours)
            with self._lock:
                self._catalog.stats.count_miss("error")
            return None

    def prefetch(self, block_hash: bytes) -> Future:
        """Read the block's file and check its checksum on the store's reader thread (I/O
        and SHA-256 overlap the caller's work): pass the future to `get`, which judges it.
        Nothing is counted, touched or deleted before that."""
        with self._lock:
            if self._reader is None:
                self._reader = ThreadPoolExecutor(1, thread_name_prefix="kvchat-prefix-reader")
            return self._reader.submit(self.files.read_checked, block_hash, self._read_limit)

    @property
    def _read_limit(self) -> int:
        return max(self.budget_bytes, 1 << 20)  # no valid entry is bigger

    def contains(self, block_hash: bytes) -> bool:
        """Whether the index holds ``block_hash`` (no disk access, no verification)."""
        with self._lock:
            return block_hash in self._catalog.index

    def put(self, salt: CacheSalt, block_hash: bytes, parent_hash: bytes,
            token_ids: Sequence[int], arrays: Sequence[np.ndarray],
            ttl_s: float | None = None, spec: EntrySpec | None = None) -> bool:
        """Write one block now; True if written. ``ttl_s`` defaults to the tenant's TTL;
        ``spec`` (format and geometry) to `EntrySpec.infer` (plain float blocks only).

        False when the block is stored or being written, alone exceeds the budget, has a TTL
        that is not positive, the store is not writable (``dropped_writes``), or on an I/O
        error (``write_errors``; a read-only or full directory stops writing, see ``degraded``).
        Raises ValueError for a block `entry.make_header` refuses.
        """
        ttl = self.ttls.for_tenant(salt.tenant) if ttl_s is None else ttl_s
        header = entry.make_header(salt, block_hash, parent_hash, token_ids, arrays,
                                   self._clock(), ttl, spec)
        size = header.file_size()
        with self._lock:
            if not self.files.writable:
                self._catalog.stats.dropped_writes += 1
                return False
            if (header.expires <= header.created or size > self.budget_bytes
                    or block_hash in self._catalog.index or block_hash in self._writing):
                return False
            self._writing.add(block_hash)
        try:
            tmp = self.files.write_temp(header, arrays)
            with self._lock:
                self.files.commit(tmp, header.block_hash)
                self._catalog.written(header, size)
        except OSError:  # a directory at the entry's path, a symlinked shard, a full disk...
            with self._lock:
                self._catalog.stats.write_errors += 1
            return False
        finally:
            with self._lock:
                self._writing.discard(block_hash)
        self.files.sync(header.block_hash)  # makes the rename itself durable
        return True

    def put_async(self, salt: CacheSalt, block_hash: bytes, parent_hash: bytes,
                  token_ids: Sequence[int], arrays: Sequence[np.ndarray],
                  ttl_s: float | None = None, spec: EntrySpec | None = None) -> bool:
        """Queue a `put` for the background writer thread; never blocks. True if queued.

        ``arrays`` must be numpy copies the caller no longer touches. A full queue, a closed
        or a non-writable store drops the write (``dropped_writes``); a stored block is skipped.
        """
        if not all(isinstance(a, np.ndarray) for a in arrays):
            raise TypeError("put_async needs numpy copies, not views of the KV pool")
        with self._lock:
            if block_hash in self._catalog.index:
                return False
            if not self.files.writable:
                self._catalog.stats.dropped_writes += 1
                return False
        item = (salt, block_hash, parent_hash, token_ids, arrays, ttl_s, spec)
        return self._writer.submit(item)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write is done; False if ``timeout`` ran out first."""
        return self._writer.flush(timeout)

    def close(self) -> None:
        """Drain the queue and stop the writer; later `put_async` calls are dropped."""
        self._writer.close()
        with self._lock:
            reader, self._reader = self._reader, None
        if reader is not None:
            reader.shutdown(cancel_futures=True)

    def __enter__(self) -> DiskPrefixStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def sweep(self) -> int:
        """Reread the tenant TTLs, delete expired entries, enforce the budget, remove kvchat
        temp files older than a minute. Returns the number of entries deleted."""
        with self._lock:
            self.ttls.reload()  # `kvchat cache ttl` may have changed them
        removed = self.purge(expired_only=True)
        stale = list(self.files.scan(entries=False))  # outside the lock: get() need not wait
        with self._lock:
            removed += self._catalog.enforce_budget()
            for path, _, _, reason in stale:
                self._catalog.remove_file(path, reason)
        return removed

    def purge(self, tenant: str | None = None, model: str | None = None,
              expired_only: bool = False, all: bool = False,
              permission_below: int | None = None) -> int:
        """Delete the entries matching every filter given; returns how many (0 if read-only).

        Args:
            tenant (str, optional): only this tenant's entries.
            model (str, optional): only entries whose model fingerprint starts with this.
            expired_only (bool): only entries past their expiry. Default: ``False``.
            all (bool): allow a purge without filters (everything). Default: ``False``.
            permission_below (int, optional): only entries with a lower permission version
                (what a permission bump made unreachable; combine with ``tenant``).

        Raises ValueError when no filter is given and ``all`` is False.
        """
        filters = (tenant, model, permission_below)
        if not (all or expired_only or any(f is not None for f in filters)):
            raise ValueError("purge needs tenant, model, expired_only, permission_below or all")
        if not self.files.tidy:
            return 0
        with self._lock:
            doomed = self._catalog.index.select(
                self.ttls, tenant=tenant, model=model, permission_below=permission_below,
                expired_at=self._clock() if expired_only else None)
            for h in doomed:
                self._catalog.drop(h, "expired" if expired_only else "purge")
        return len(doomed)

    def remove(self, block_hashes: Sequence[bytes]) -> int:
        """Delete the entries named (a document session's blocks); returns how many."""
        if not self.files.tidy:
            return 0
        with self._lock:
            doomed = [h for h in dict.fromkeys(block_hashes) if h in self._catalog.index]
            for h in doomed:
                self._catalog.drop(h, "purge")
        return len(doomed)

    def set_tenant_ttl(self, tenant: str, ttl_s: float | None) -> int:
        """Set (None: clear) the tenant's TTL for every store on this directory.

        Saved in the directory: engines opened later write with it, running ones take it at
        their next `sweep`. It also caps the age of existing entries: those past it are
        deleted now; returns how many. Raises KVChatError in a read-only or disabled store,
        ValueError for a TTL that is not a positive finite number, OSError if not saved.
        """
        if not self.files.tidy:
            raise KVChatError(f"cannot set a TTL: {self.degraded}")
        with self._lock:
            self.ttls.save(tenant, ttl_s)
        return self.purge(tenant=tenant, expired_only=True)

    def entries(self) -> list[EntryInfo]:
        """Every indexed entry, most recently used first."""
        with self._lock:
            return self._catalog.index.infos(self.ttls)

    def stats(self) -> StoreStats:
        """A snapshot of the counters and the current size."""
        with self._lock:
            return self._catalog.snapshot(self._writer)

    def _read(self, salt, block_hash, token_ids, expect, read) -> list[np.ndarray] | None:
        try:
            header, arrays, st = self.files.load(block_hash, self._read_limit, salt, token_ids,
                                                 expect, read)
            if self._clock() >= self.ttls.expiry(header):
                raise EntryError("expired", inode=st.st_ino)
        except EntryError as e:
            with self._lock:
                self._catalog.miss(block_hash, e.reason, e.inode)
            return None
        now = self._clock()  # not under the lock: a clock may be slow
        with self._lock:
            self._catalog.hit(header, st, now)
        return arrays
