"""What the app remembers between runs (theme, last model and chat, KV cache format, the
default generation settings), in ``cache_root()/settings.json``.

The file is written atomically and privately (0600) and read back only when it is
still private: the last model is loaded at start-up, so a file others could write
is ignored rather than trusted. Keys this version does not know are kept as they are.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from engine.paths import cache_root, private_dir, read_private, write_private

KV_CACHE_FORMATS: dict[str, tuple[int | None, int | None]] = {
    "float": (None, None),
    "q8": (8, 8),
    "q4": (4, 4),
    "k8v4": (8, 4),
    "q8-kivi": (8, 8),
    "k8v4-kivi": (8, 4),
    "q4-kivi": (4, 4),
}
"""The KV cache formats the settings offer: name -> (K bits, V bits); None = unquantized.

"float" stores K/V in the model's float dtype (the engine's default); the others are the
engine's 8/4-bit affine formats, K and V chosen apart for "k8v4" (K is the more sensitive).
The `KV_KIVI` ones quantize a block once it fills (float16 until then), keys per channel.
"""

KV_KIVI = frozenset({"q8-kivi", "k8v4-kivi", "q4-kivi"})
"""Formats stored as `EngineConfig.kv_residual` + ``kv_key_channel`` (KIVI's layout)."""

KV_MEASURED_COST: dict[str, float] = {"q8": 0.09, "k8v4": 0.44, "q4": 6.60, "q8-kivi": 0.03,
                                      "k8v4-kivi": -0.26, "q4-kivi": 0.69}
"""Perplexity change against float16 in %, measured for the default model on held-out text
(the README's "KV cache formats, measured"): what the settings say of each format."""
KV_COSTLY_PCT = 1.0
"""A format whose measured cost exceeds this many % is marked costly."""


@dataclass(slots=True)
class GenerationSettings:
    """How answers are sampled: the app's defaults, or one chat's own (saved with it).

    Raises ValueError from the constructor when a value is out of the engine's range.
    """

    temperature: float = 0.0
    """0 picks the likeliest token (greedy); higher samples more freely."""
    top_p: float = 0.0
    """Nucleus sampling: keep the likeliest tokens up to this probability; 0 = off."""
    max_tokens: int = 512
    """The longest answer, in tokens."""
    repetition_penalty: float = 1.0
    """Above 1 discourages repeating earlier tokens (a small model that loops); 1 = off."""

    def __post_init__(self):
        for name, low, high in (("temperature", 0.0, 100.0), ("top_p", 0.0, 1.0),
                                ("repetition_penalty", 0.01, 100.0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) \
                    or not math.isfinite(value) or not low <= value <= high:
                raise ValueError(f"{name.replace('_', ' ')} must be a number from {low:g} "
                                 f"to {high:g}, got {value!r}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) \
                or not 1 <= self.max_tokens <= 1_000_000:
            raise ValueError(f"max tokens must be a whole number from 1 to 1000000, "
                             f"got {self.max_tokens!r}")

    @classmethod
    def from_dict(cls, data: dict | None,
                  base: GenerationSettings | None = None) -> GenerationSettings:
        """``base`` (or the defaults) with the valid keys of ``data``; bad values are dropped."""
        out = base if base is not None else cls()
        for name in GENERATION_KEYS:
            if isinstance(data, dict) and name in data:
                try:
                    out = cls(**{**asdict(out), name: data[name]})
                except (TypeError, ValueError):
                    continue
        return out

    def to_dict(self) -> dict:
        return asdict(self)

    def changes(self, base: GenerationSettings) -> dict:
        """The values that differ from ``base`` (what a chat saves of its own)."""
        return {k: v for k, v in asdict(self).items() if v != getattr(base, k)}


GENERATION_KEYS = tuple(f.name for f in fields(GenerationSettings))


@dataclass(slots=True)
class AppSettings:
    """The remembered settings; None means "not set" (the app's default applies)."""

    theme: str | None = None
    """Textual theme name, e.g. "textual-dark"."""
    last_model: str | None = None
    """Model spec loaded last ("default", a path or a hub repo id)."""
    kv_cache: str | None = None
    """KV cache format, a key of `KV_CACHE_FORMATS`; the command line's KV flags override it."""
    last_conversation: str | None = None
    """The chat open when kvchat quit (its id); reopened at the next start."""
    generation: dict | None = None
    """The default generation settings (a `GenerationSettings` as a dict); chats may differ."""
    extra: dict = field(default_factory=dict)
    """Keys written by another kvchat version, saved back unchanged."""

    @classmethod
    def from_dict(cls, data: dict) -> AppSettings:
        """Settings from the JSON object; a known key with a value of the wrong type is dropped."""
        known = {f.name for f in fields(cls)} - {"extra"}
        values = {k: v if isinstance(v, dict if k == "generation" else str) and v else None
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


def save_settings(**changes: str | dict | None) -> AppSettings:
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


def kv_cache_kivi(name: str | None) -> bool:
    """Whether a KV cache format quantizes blocks once full, keys per channel (`KV_KIVI`)."""
    return name in KV_KIVI


def generation_defaults() -> GenerationSettings:
    """The saved default generation settings (missing or bad values: the built-in ones)."""
    return GenerationSettings.from_dict(load_settings().generation)


def last_model() -> str | None:
    """The model spec loaded last, or None."""
    return load_settings().last_model


def remember_model(name: str) -> None:
    """Remember ``name`` as the model to load next time."""
    save_settings(last_model=name)
