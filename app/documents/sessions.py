"""Named document sessions: a pinned prompt prefix (a document) with its own lifetime.

A session records which document (by content hash) was pinned, with which model and KV
format, how many tokens its prefix holds, the chained hashes of its full blocks, and when
it expires. The blocks themselves are ordinary prefix-cache entries written with the
session's TTL; the record lets ``kvchat cache ls`` show the session and ``cache purge
--session`` remove exactly its blocks. A changed document hashes differently, so it is a
new session: its blocks can never match the old ones.

The registry is one private JSON file beside the disk store's entries; a file that is
not private, not ours or not valid JSON reads as empty (and is replaced on the next save).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from engine.paths import read_private, write_private

SESSIONS_FILE = "doc-sessions.json"
DEFAULT_SESSION_TTL_S = 24 * 3600.0


@dataclass(slots=True)
class DocSession:
    """One pinned document prefix."""

    name: str
    documents: list[dict]  # name, path, sha256, tokens of each document
    model: str  # model fingerprint
    kv_format: str
    tenant: str
    prefix_tokens: int
    created: float
    expires: float
    block_hashes: list[str] = field(default_factory=list)  # hex chain hashes of full blocks
    questions: int = 0

    def expired(self, now: float | None = None) -> bool:
        return (time.time() if now is None else now) >= self.expires

    def same_content(self, other: DocSession) -> bool:
        """Same documents (by hash), model, format and tenant: the same cached prefix."""
        def key(s: DocSession):
            return ([d["sha256"] for d in s.documents], s.model, s.kv_format, s.tenant)
        return key(self) == key(other)


class SessionRegistry:
    """The sessions saved in ``root`` (a disk store's directory)."""

    def __init__(self, root: Path):
        self.path = Path(root) / SESSIONS_FILE

    def load(self) -> dict[str, DocSession]:
        """Every saved session by name (expired ones included; see `sweep`)."""
        raw = read_private(self.path)
        if raw is None:
            return {}
        try:
            rows = json.loads(raw)
            return {r["name"]: DocSession(**r) for r in rows if isinstance(r, dict)}
        except (ValueError, TypeError, KeyError):
            return {}  # a damaged registry loses names only: entries expire on their own

    def _save(self, sessions: dict[str, DocSession]) -> None:
        if not self.path.parent.is_dir():
            return
        rows = [asdict(s) for s in sorted(sessions.values(), key=lambda s: s.created)]
        write_private(self.path, json.dumps(rows, indent=1).encode())

    def get(self, name: str) -> DocSession | None:
        s = self.load().get(name)
        return None if s is None or s.expired() else s

    def save(self, session: DocSession) -> None:
        """Add or replace ``session`` (by name)."""
        sessions = self.load()
        sessions[session.name] = session
        self._save(sessions)

    def remove(self, name: str) -> DocSession | None:
        """Forget ``name``; the removed record, or None if there was none."""
        sessions = self.load()
        gone = sessions.pop(name, None)
        if gone is not None:
            self._save(sessions)
        return gone

    def sweep(self, now: float | None = None) -> list[DocSession]:
        """Forget expired sessions; returns them."""
        sessions = self.load()
        gone = [s for s in sessions.values() if s.expired(now)]
        if gone:
            self._save({n: s for n, s in sessions.items() if not s.expired(now)})
        return gone
