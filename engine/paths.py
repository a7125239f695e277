"""Where kvchat keeps its files (converted models, fingerprints, later the prefix store)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """The user cache directory for kvchat: ``$KVCHAT_HOME`` or ``~/.cache/kvchat``."""
    env = os.environ.get("KVCHAT_HOME")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "kvchat"


def private_dir(path: Path) -> Path:
    """Create ``path`` (and parents) with mode 0700 and return it."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path, 0o700)
    return path
