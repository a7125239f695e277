"""API keys -> tenants: the keys file, its permission check, constant-time lookup, reload.

The keys file is JSON, ``{"<key>": {"tenant": "alice", "permission_version": 3}, ...}``.
It holds secrets, so it must be a regular file of ours that nobody else can read or
write (mode 0600 or stricter); anything else is refused. A lookup hashes the presented
key and compares it with every stored key's hash with `hmac.compare_digest`, never
stopping early, so neither the time taken nor the key lengths tell which keys exist.
`reload` (on SIGHUP) swaps the whole table at once; a bad file keeps the old table.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from engine.errors import KVChatError
from engine.validation import MAX_TENANT_LEN

LOCAL_TENANT = "local"
MAX_KEYS_FILE_BYTES = 1 << 20
MIN_KEY_CHARS = 8
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


@dataclass(frozen=True, slots=True)
class Principal:
    """Who a request runs as: its prefix-cache scope."""

    tenant: str
    permission_version: int = 0


LOCAL = Principal(LOCAL_TENANT, 0)


class KeysFileError(KVChatError):
    """The keys file is missing, not private, or not a valid keys table."""


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def read_keys_file(path: Path) -> dict[bytes, Principal]:
    """Parse and check a keys file: {sha256(key): Principal}. Raises `KeysFileError`."""
    try:  # O_NONBLOCK: a FIFO put in its place must not hang the open
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
                     | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        raise KeysFileError(f"cannot read the keys file {path}: {e.strerror}") from None
    try:
        st = os.fstat(fd)  # checked on the open file: the file checked is the file read
        if not stat.S_ISREG(st.st_mode):
            raise KeysFileError(f"the keys file {path} is not a regular file")
        if st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise KeysFileError(
                f"the keys file {path} must be yours and mode 0600 (it is "
                f"{stat.S_IMODE(st.st_mode):04o}); run: chmod 600 {path}")
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(MAX_KEYS_FILE_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_KEYS_FILE_BYTES:
        raise KeysFileError(f"the keys file {path} is larger than {MAX_KEYS_FILE_BYTES} bytes")
    try:
        table = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise KeysFileError(f"the keys file {path} is not valid JSON: {e}") from None
    except RecursionError:  # a hostile file of deeply nested brackets
        raise KeysFileError(f"the keys file {path} is nested too deeply to be a keys "
                            "file") from None
    if not isinstance(table, dict) or not table:
        raise KeysFileError(f"the keys file {path} must be a non-empty JSON object "
                            '{"<key>": {"tenant": ..., "permission_version": N}}')
    return {_digest(key): _principal(key, entry, path) for key, entry in table.items()}


def _principal(key: str, entry, path: Path) -> Principal:
    where = f"the keys file {path}, key {key[:4]}..."  # never print a whole key
    if len(key) < MIN_KEY_CHARS or not key.isprintable() or key != key.strip():
        raise KeysFileError(f"{where}: a key must be at least {MIN_KEY_CHARS} printable "
                            "characters without surrounding spaces")
    if not isinstance(entry, dict) or set(entry) - {"tenant", "permission_version"}:
        raise KeysFileError(f'{where}: expected {{"tenant": ..., "permission_version": N}}')
    tenant = entry.get("tenant")
    version = entry.get("permission_version", 0)
    if not isinstance(tenant, str) or not 0 < len(tenant) <= MAX_TENANT_LEN \
            or not tenant.isprintable():
        raise KeysFileError(f"{where}: tenant must be 1..{MAX_TENANT_LEN} printable characters")
    if isinstance(version, bool) or not isinstance(version, int) or not 0 <= version < 1 << 63:
        raise KeysFileError(f"{where}: permission_version must be an integer in [0, 2^63)")
    return Principal(tenant, version)


class KeyStore:
    """The server's API keys; without a keys file every request is the local tenant."""

    def __init__(self, path: str | Path | None = None):
        self.path = Path(path) if path is not None else None
        self._table: dict[bytes, Principal] = read_keys_file(self.path) if self.path else {}

    @property
    def required(self) -> bool:
        """Whether requests must present a key (a keys file is in use)."""
        return self.path is not None

    @property
    def tenants(self) -> set[str]:
        """The tenants the keys map to."""
        return {p.tenant for p in self._table.values()}

    def lookup(self, key: str | None) -> Principal | None:
        """The principal of ``key``; None for a missing or unknown key (when keys are required)."""
        if not self.required:
            return LOCAL
        if not key:
            return None
        presented = _digest(key)
        found = None
        for digest, principal in self._table.items():  # every key, no early exit
            if hmac.compare_digest(presented, digest):
                found = principal
        return found

    def reload(self) -> str:
        """Re-read the keys file; keeps the old table (and raises) if the new one is bad."""
        if self.path is None:
            return "no keys file: nothing to reload"
        self._table = read_keys_file(self.path)  # one assignment: lookups see old or new
        return f"reloaded {len(self._table)} keys for {len(self.tenants)} tenants"


def bearer_key(authorization: str | None) -> str | None:
    """The key in an ``Authorization: Bearer <key>`` header, else None."""
    if not authorization:
        return None
    scheme, _, key = authorization.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return key.strip() or None
