"""Checks of single request values: each returns the value to store, or raises a 400
(`APIError`) naming the field. Shared by the request schemas."""

from __future__ import annotations

import math
from collections.abc import Callable

from app.server.errors import invalid, unsupported


def number(name: str, value, lo: float, hi: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise invalid(f"{name} must be a number, got {value!r:.40}", name)
    if not lo <= value <= hi:
        raise invalid(f"{name} must be in [{lo:g}, {hi:g}], got {value!r}", name)
    return float(value)


def integer(name: str, value, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(f"{name} must be an integer, got {value!r:.40}", name)
    if not lo <= value < hi:
        raise invalid(f"{name} must be an integer in [{lo}, {hi}), got {value}", name)
    return value


def boolean(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise invalid(f"{name} must be true or false, got {value!r:.40}", name)
    return value


def string(name: str, value) -> str:
    if not isinstance(value, str):
        raise invalid(f"{name} must be a string", name)
    return unicode_text(name, value)


def unicode_text(name: str, value: str) -> str:
    """A string that UTF-8 can encode: JSON's ``"\\ud800"`` escapes decode to lone
    surrogates, which the tokenizer cannot take."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise invalid(f"{name} is not valid Unicode text (a lone UTF-16 surrogate)",
                      name) from None
    return value


def only(allowed: tuple, what: str) -> Callable:
    """A field accepted only at values that change nothing (e.g. n = 1, logprobs = false)."""
    def check(name: str, value):
        # == alone would let True pass for 1 and False for 0
        if not any(value == a and isinstance(value, bool) == isinstance(a, bool)
                   for a in allowed):
            raise unsupported(name, what)
    return check
