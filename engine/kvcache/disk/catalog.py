"""The disk store's catalog of its entries, kept true to the files: index, counters, deletions.

An entry is indexed only once its file has been judged (at open, on a hit, on a write), and it
leaves the index with its file; every file deleted is counted by its reason, and the byte
budget is enforced here, least recently used first. Nothing here locks:
`store.DiskPrefixStore` holds its lock around every call.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path

from engine.kvcache.disk.entry import EntryHeader
from engine.kvcache.disk.files import EntryFiles
from engine.kvcache.disk.index import EntryIndex, StoreStats
from engine.kvcache.disk.writer import BackgroundWriter

Scanned = tuple[Path, EntryHeader | None, os.stat_result | None, str | None]  # `files.scan`


class Catalog:
    """The entries of ``files`` that may be served, their total size and the store's counters.

    Args:
        files (EntryFiles): the store's entry files.
        budget_bytes (int): total file bytes kept.
    """

    def __init__(self, files: EntryFiles, budget_bytes: int):
        self.files, self.budget_bytes = files, budget_bytes
        self.index = EntryIndex()
        self.stats = StoreStats(budget_bytes=budget_bytes)

    def load(self, scanned: Iterable[Scanned], expiry: Callable[[EntryHeader], float],
             now: float) -> None:
        """Index the entries a scan found good and unexpired at ``now``; delete the rest
        (and what the budget has no room for)."""
        for path, header, st, reason in scanned:
            if reason is None and now >= expiry(header):
                reason = "expired"
            if reason is None:
                self.index.add(header.block_hash, st.st_size, st.st_mtime, header)
            else:
                self.remove_file(path, reason)
        self.enforce_budget()

    def hit(self, header: EntryHeader, st: os.stat_result, now: float) -> None:
        """Count a served entry and make it the most recently used, in the index and in
        its file's mtime (so LRU order survives restarts)."""
        self.stats.hits += 1
        indexed = self.index.get(header.block_hash)
        if indexed is None:  # another process wrote it after our scan
            self.index.add(header.block_hash, st.st_size, now, header)
        else:
            indexed.last_used = now
        self.files.touch(header.block_hash, now)

    def miss(self, block_hash: bytes, reason: str, inode: int | None = None) -> None:
        """Count a miss; forget an absent entry, delete the file judged (``inode``), clear
        a symlinked shard or a directory at the entry's path (`EntryFiles.reclaim`)."""
        self.stats.count_miss(reason)
        if reason == "absent":
            self.index.pop(block_hash)
        elif inode is not None:  # only the file judged: our writer may have replaced it
            self.drop(block_hash, reason, inode)
        elif reason in ("unsafe_dir", "io_error") and self.files.clear_blockers(block_hash):
            self.index.pop(block_hash)
            self.stats.count_removal(reason)

    def written(self, header: EntryHeader, size: int) -> None:
        """Index an entry just committed, then make room for it within the budget."""
        self.index.add(header.block_hash, size, header.created, header)
        self.stats.writes += 1
        self.enforce_budget()

    def drop(self, block_hash: bytes, reason: str, inode: int | None = None) -> None:
        """Forget an entry and delete its file (only if it is still ``inode``, when given)."""
        self.index.pop(block_hash)
        self.remove_file(self.files.path(block_hash), reason, inode)

    def remove_file(self, path: Path, reason: str, inode: int | None = None) -> None:
        """Delete a file, counting it under ``reason`` if it went."""
        if self.files.remove(path, inode):
            self.stats.count_removal(reason)

    def enforce_budget(self) -> int:
        """Drop least recently used entries until the rest fit; returns how many."""
        doomed = self.index.over_budget(self.budget_bytes) if self.files.tidy else []
        for h in doomed:
            self.drop(h, "budget")
        return len(doomed)

    def snapshot(self, writer: BackgroundWriter) -> StoreStats:
        """The counters, with the current size and the background writer's own."""
        s = self.stats
        return replace(
            s, entries=len(self.index), bytes=self.index.bytes,
            write_errors=s.write_errors + writer.failed,
            dropped_writes=s.dropped_writes + writer.dropped, pending_writes=writer.pending,
            misses_by_reason=dict(s.misses_by_reason),
            removed_by_reason=dict(s.removed_by_reason))
