"""Content fingerprints of model weights and tokenizers, for cache keys.

A fingerprint hashes file *contents*, never paths: the same weights copied
elsewhere keep their fingerprint; a changed byte changes it. Digests of large
files are memoized by (path, size, mtime) so start-up does not rehash them. The
memo feeds cache salts, so it is trusted only when its file is private (ours, not
writable by group or others); otherwise it is ignored and rewritten privately.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path

from engine.paths import cache_root, private_dir, read_private, write_private

_CHUNK = 1 << 22
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)


def _memo_path() -> Path:
    return cache_root() / "fingerprints.json"


def _load_memo() -> dict[str, str]:
    """The memo, or {} when it is missing, corrupt or not private (anyone could forge it)."""
    raw = read_private(_memo_path())
    if raw is None:
        return {}
    try:
        memo = json.loads(raw)
    except ValueError:
        return {}
    if not isinstance(memo, dict):
        return {}
    return {k: v for k, v in memo.items() if isinstance(k, str) and isinstance(v, str)}


def _save_memo(memo: dict[str, str]) -> None:
    path = _memo_path()
    try:
        private_dir(path.parent)
        write_private(path, json.dumps(memo).encode())
    except OSError:
        pass  # the memo is only an optimization


def file_digest(path: Path) -> str:
    """sha256 hex digest of one file's contents, memoized by (path, size, mtime)."""
    path = Path(path).resolve()
    st = path.stat()
    key = f"{path}|{st.st_size}|{st.st_mtime_ns}"
    memo = _load_memo()
    if key in memo:
        return memo[key]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    digest = h.hexdigest()
    memo[key] = digest
    _save_memo(memo)
    return digest


def combine(parts: Iterable[tuple[str, str]]) -> str:
    """Hash (name, digest) pairs in order into one hex digest."""
    h = hashlib.sha256()
    for name, digest in parts:
        h.update(name.encode())
        h.update(b"\0")
        h.update(digest.encode())
        h.update(b"\0")
    return h.hexdigest()


def model_fingerprint(model_dir: Path) -> str:
    """Fingerprint of a model directory: its weight files and config, by content."""
    model_dir = Path(model_dir)
    files = sorted(model_dir.glob("*.safetensors")) + [model_dir / "config.json"]
    return combine((f.name, file_digest(f)) for f in files if f.exists())


def tokenizer_fingerprint(model_dir: Path) -> str:
    """Fingerprint of the tokenizer files (vocabulary, merges, chat template)."""
    model_dir = Path(model_dir)
    files = [model_dir / n for n in TOKENIZER_FILES if (model_dir / n).exists()]
    return combine((f.name, file_digest(f)) for f in files)
