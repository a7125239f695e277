"""The disk store's bookkeeping: which entries exist, their size, last use and expiry; counters.

Nothing here locks: `store.DiskPrefixStore` holds its lock around every call.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from engine.kvcache.disk.entry import EntryHeader
from engine.paths import read_private, write_private


@dataclass(slots=True)
class StoreStats:
    """Counters since the store object was opened, plus its current size."""

    entries: int = 0
    bytes: int = 0
    budget_bytes: int = 0
    hits: int = 0
    misses: int = 0
    writes: int = 0
    write_errors: int = 0  # attempted and failed: I/O error, malformed block
    dropped_writes: int = 0  # not attempted: queue full, store closed or not writable
    evictions: int = 0  # deleted to stay within the byte budget
    expired_removed: int = 0
    misses_by_reason: dict[str, int] = field(default_factory=dict)
    removed_by_reason: dict[str, int] = field(default_factory=dict)  # every file deletion
    pending_writes: int = 0

    def to_dict(self) -> dict:
        return asdict(self)

    def count_miss(self, reason: str) -> None:
        self.misses += 1
        self.misses_by_reason[reason] = self.misses_by_reason.get(reason, 0) + 1

    def count_removal(self, reason: str) -> None:
        self.removed_by_reason[reason] = self.removed_by_reason.get(reason, 0) + 1
        self.expired_removed += reason == "expired"
        self.evictions += reason == "budget"


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
    expires: float  # the earlier of the header's expiry and the tenant's TTL
    last_used: float


@dataclass(slots=True)
class IndexedEntry:
    size: int
    last_used: float
    header: EntryHeader


class TenantTTLs:
    """Entry lifetimes: a default, and per-tenant ones from code and from a file.

    The file (written by `save`, e.g. through ``kvchat cache ttl``) lives in the store's
    directory, so every process using it agrees; where code and file both name a tenant, the
    shorter wins. A tenant's TTL also caps the age of its entries written before it was set:
    cached K/V is user data, and lowering a TTL must not leave older entries behind.

    Args:
        path (Path, optional): the TTL file; None reads none (an untrusted directory).
        default_s (float): lifetime of entries of tenants without their own.
        own (dict[str, float], optional): per-tenant lifetimes from code.
    """

    def __init__(self, path: Path | None, default_s: float, own: dict[str, float] | None):
        self.path, self.default_s, self._own = path, default_s, dict(own or {})
        self.by_tenant: dict[str, float] = {}
        self.reload()

    def reload(self) -> None:
        """Reread the file (another process may have changed it)."""
        ttls = read_ttls(self.path) if self.path is not None else {}
        for tenant, ttl in self._own.items():
            ttls[tenant] = min(ttl, ttls.get(tenant, ttl))
        self.by_tenant = ttls

    def for_tenant(self, tenant: str) -> float:
        """The lifetime of a new entry of ``tenant``."""
        return self.by_tenant.get(tenant, self.default_s)

    def expiry(self, header: EntryHeader) -> float:
        """When an entry expires: its header's time, or earlier under its tenant's TTL."""
        ttl = self.by_tenant.get(header.salt.tenant)
        return header.expires if ttl is None else min(header.expires, header.created + ttl)

    def save(self, tenant: str, ttl_s: float | None) -> None:
        """Set (None: clear) the tenant's TTL in the file.

        Raises:
            ValueError: ``ttl_s`` is not a positive finite number.
            OSError: the file cannot be written.
        """
        if ttl_s is not None and (type(ttl_s) not in (int, float) or not 0 < ttl_s < math.inf):
            raise ValueError(f"a TTL must be a positive number of seconds, got {ttl_s!r}")
        if self.path is None:
            raise OSError(f"no TTL file to write for {tenant!r}")
        saved = read_ttls(self.path)
        if ttl_s is None:
            saved.pop(tenant, None)
        else:
            saved[tenant] = float(ttl_s)
        write_ttls(self.path, saved)
        self.reload()


class EntryIndex:
    """Indexed entries by block hash, with their total size in ``bytes``.

    The index holds every entry's header for as long as its file lives (thousands within the
    disk budget), so the parts equal across entries (salt, spec, the tensors' dtypes and
    shapes: ~11 KiB for a 30-layer block, parsed or built anew for each one) are kept once.
    """

    MAX_SHARED = 256  # distinct salts/specs/tensor lists remembered; then start over

    def __init__(self):
        self._entries: dict[bytes, IndexedEntry] = {}
        self._shared: dict[object, object] = {}
        self.bytes = 0

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, block_hash: bytes) -> IndexedEntry | None:
        return self._entries.get(block_hash)

    def add(self, block_hash: bytes, size: int, last_used: float, header: EntryHeader) -> None:
        """Index an entry (replacing one of the same hash)."""
        self.pop(block_hash)
        if len(self._shared) > self.MAX_SHARED:
            self._shared.clear()
        share = self._shared.setdefault
        header = replace(header, salt=share(header.salt, header.salt),
                         spec=share(header.spec, header.spec),
                         tensors=share(tuple(header.tensors), header.tensors))
        self._entries[block_hash] = IndexedEntry(size, last_used, header)
        self.bytes += size

    def pop(self, block_hash: bytes) -> None:
        """Forget an entry, if indexed."""
        entry = self._entries.pop(block_hash, None)
        if entry is not None:
            self.bytes -= entry.size

    def over_budget(self, budget_bytes: int) -> list[bytes]:
        """The least recently used hashes to drop to fit ``budget_bytes``."""
        doomed, excess = [], self.bytes - budget_bytes
        for h, e in sorted(self._entries.items(), key=lambda kv: kv[1].last_used):
            if excess <= 0:
                break
            doomed.append(h)
            excess -= e.size
        return doomed

    def select(self, ttls: TenantTTLs, *, tenant: str | None = None, model: str | None = None,
               permission_below: int | None = None, expired_at: float | None = None
               ) -> list[bytes]:
        """Hashes of the entries matching every filter given (see `DiskPrefixStore.purge`)."""
        return [
            h for h, e in self._entries.items()
            if (tenant is None or e.header.salt.tenant == tenant)
            and (model is None or e.header.salt.model_fingerprint.startswith(model))
            and (permission_below is None or e.header.salt.permission_version < permission_below)
            and (expired_at is None or expired_at >= ttls.expiry(e.header))
        ]

    def infos(self, ttls: TenantTTLs) -> list[EntryInfo]:
        """Every entry, most recently used first."""
        return [
            EntryInfo(hash=h.hex(), tenant=e.header.salt.tenant,
                      permission_version=e.header.salt.permission_version,
                      model=e.header.salt.model_fingerprint, tokens=len(e.header.token_ids),
                      bytes=e.size, created=e.header.created, expires=ttls.expiry(e.header),
                      last_used=e.last_used)
            for h, e in sorted(self._entries.items(), key=lambda kv: -kv[1].last_used)
        ]


def read_ttls(path: Path) -> dict[str, float]:
    """Per-tenant TTLs saved by `write_ttls`; invalid items are skipped, {} if there are none
    or the file is not a private one of ours (`paths.read_private`)."""
    try:
        doc = json.loads(read_private(path) or b"{}")
    except ValueError:
        return {}
    if not isinstance(doc, dict):
        return {}
    return {
        t: float(s) for t, s in doc.items()
        if type(s) in (int, float) and math.isfinite(s) and s > 0
    }


def write_ttls(path: Path, ttls: dict[str, float]) -> None:
    """Save per-tenant TTLs atomically, mode 0600.

    Raises:
        OSError: the directory takes no writes.
    """
    write_private(path, json.dumps(ttls, sort_keys=True, indent=1).encode())
