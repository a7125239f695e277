"""What the app remembers between runs (theme, last model, KV cache format), in
``cache_root()/settings.json``.

The file is written atomically and privately (0600) and read back only when it is
still private: the last model is loaded at start-up, so a file others could write
is ignored rather than trusted. Keys this version does not know are kept as they are.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path

from engine.paths import cache_root, private_dir, read_private, write_private

KV_CACHE_FORMATS: dict[str, tuple[int | None, int | None]] = {
    "float": (None, None),
    "q8": (8, 8),
    "q4": (4, 4),
    "k8v4": (8, 4),
}
"""The KV cache formats the settings offer: name -> (K bits, V bits); None = unquantized.

"float" stores K/V in the model's float dtype (the engine's default); the others are the
engine's 8/4-bit affine formats, K and V chosen apart for "k8v4" (K is the more sensitive).
"""


@dataclass(slots=True)
class AppSettings:
    """The remembered settings; None means "not set" (the app's default applies)."""

    theme: str | None = None
    """Textual theme name, e.g. "textual-dark"."""
    last_model: str | None = None
    """Model spec loaded last ("default", a path or a hub repo id)."""
    kv_cache: str | None = None
    """KV cache format, a key of `KV_CACHE_FORMATS`; the command line's KV flags override it."""
    extra: dict = field(default_factory=dict)
    """Keys written by another kvchat version, saved back unchanged."""

    @classmethod
    def from_dict(cls, data: dict) -> AppSettings:
        """Settings from the JSON object; a known key with a non-string value is dropped."""
        known = {f.name for f in fields(cls)} - {"extra"}
        values = {k: v if isinstance(v, str) and v else None
                  for k, v in data.items() if k in known}
        return cls(**values, extra={k: v for k, v in data.items() if k not in known})

    def to_dict(self) -> dict:
        """The JSON object to save: set fields and the kept unknown keys."""
        out = dict(self.extra)
        out.update({f.name: getattr(self, f.name) for f in fields(self)
                    if f.name != "extra" and getattr(self, f.name) is not None})
        return out


def settings_path() -> Path:
    """Where the settings live: ``cache_root()/settings.json``."""
    return cache_root() / "settings.json"


def load_settings() -> AppSettings:
    """The saved settings; defaults when the file is missing, corrupt or not private."""
    raw = read_private(settings_path())
    try:
        data = json.loads(raw) if raw is not None else {}
    except ValueError:
        data = {}
    return AppSettings.from_dict(data if isinstance(data, dict) else {})


def save_settings(**changes: str | None) -> AppSettings:
    """Merge ``changes`` (field=value) into the saved settings and write them; return them.

    Raises:
        OSError: the cache directory or the file cannot be written.
        TypeError: an unknown setting name.
    """
    current = load_settings()
    for name, value in changes.items():
        if name == "extra" or not hasattr(current, name):
            raise TypeError(f"unknown setting {name!r}")
        setattr(current, name, value)
    private_dir(cache_root())
    write_private(settings_path(), json.dumps(current.to_dict(), indent=1).encode("utf-8"))
    return current


def kv_cache_bits(name: str | None) -> tuple[int | None, int | None] | None:
    """(K bits, V bits) of a KV cache format; None when unset or unknown (a newer version's)."""
    return KV_CACHE_FORMATS.get(name) if name else None


def last_model() -> str | None:
    """The model spec loaded last, or None."""
    return load_settings().last_model


def remember_model(name: str) -> None:
    """Remember ``name`` as the model to load next time."""
    save_settings(last_model=name)
