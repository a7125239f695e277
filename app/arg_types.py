"""Value checks for command-line arguments, written once for every subcommand.

Each function is an argparse ``type=``: it returns the parsed value or raises
`argparse.ArgumentTypeError` with one line naming the allowed range, so a bad value
ends as ``kvchat: error: argument --seed: ...`` and exit status 2, never a traceback.
The ranges match what the engine accepts (`SamplingParams`, `EngineConfig`, `submit`).
"""

from __future__ import annotations

import argparse
import math
import os
import stat

SEED_LIMIT = 1 << 64  # seeds are unsigned 64-bit in MLX's random state
MAX_BLOCK_SIZE = 1024
MAX_TENANT_CHARS = 128
MAX_SIZE_BYTES = 1 << 50  # 1 PiB: anything larger is a typo, not a memory size
UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
MAX_DURATION_S = 3650 * 86400  # ten years: anything longer is a typo


def _fail(message: str, text: str) -> argparse.ArgumentTypeError:
    return argparse.ArgumentTypeError(f"{message}, got {text!r}")


def _int(text: str, what: str) -> int:
    try:
        return int(text.strip(), 10)
    except ValueError:
        raise _fail(f"must be {what}", text) from None


def _float(text: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise _fail(f"must be {what}", text) from None
    if not math.isfinite(value):  # nan and inf parse as floats but sample garbage
        raise _fail(f"must be {what}", text)
    return value


def int_in(low: int, high: int | None = None):
    """A type for integers in [low, high] (no upper bound when ``high`` is None)."""
    what = f"an integer >= {low}" if high is None else f"an integer in {low}..{high}"

    def check(text: str) -> int:
        value = _int(text, what)
        if value < low or (high is not None and value > high):
            raise _fail(f"must be {what}", text)
        return value

    check.__name__ = f"int_in_{low}"
    return check


positive_int = int_in(1)
non_negative_int = int_in(0)


def seed(text: str) -> int:
    """A sampling seed in [0, 2^64)."""
    what = "an integer in [0, 2^64)"
    value = _int(text, what)
    if not 0 <= value < SEED_LIMIT:
        raise _fail(f"must be {what}", text)
    return value


def block_size(text: str) -> int:
    """Tokens per KV block, 1..1024 (as `EngineConfig` allows)."""
    what = f"an integer in 1..{MAX_BLOCK_SIZE}"
    value = _int(text, what)
    if not 1 <= value <= MAX_BLOCK_SIZE:
        raise _fail(f"must be {what}", text)
    return value


def temperature(text: str) -> float:
    """A finite temperature >= 0 (0 = greedy)."""
    value = _float(text, "a finite number >= 0")
    if value < 0:
        raise _fail("must be a finite number >= 0", text)
    return value


def unit_interval(text: str) -> float:
    """A finite number in [0, 1] (top-p, min-p, shares of a workload)."""
    value = _float(text, "a number in [0, 1]")
    if not 0 <= value <= 1:
        raise _fail("must be a number in [0, 1]", text)
    return value


def size(text: str) -> int:
    """'512M', '2G', '1.5GiB', '1048576' -> bytes: finite, positive, at most 1 PiB."""
    what = "a positive size such as 512M or 2G, at most 1024T"
    body = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = UNITS.get(body[-1:], 1)
    number = body[:-1] if scale > 1 else body
    try:
        value = float(number) * scale
    except ValueError:
        value = math.nan
    # inf, 1e400 (which parses as inf), nan, 0 and negatives all fail this one test.
    if not (math.isfinite(value) and 1 <= value <= MAX_SIZE_BYTES):
        raise _fail(f"must be {what}", text)
    return int(value)


def parse_size(text: str) -> int:
    """`size` for callers outside argparse: raises ValueError on a bad size."""
    try:
        return size(text)
    except argparse.ArgumentTypeError as e:
        raise ValueError(str(e)) from None


def duration(text: str) -> float:
    """'3600', '90s', '30m', '12h', '7d' -> seconds: positive, finite, at most ten years."""
    body = text.strip().lower()
    scale = DURATION_UNITS.get(body[-1:], 0)
    try:
        value = float(body[:-1] if scale else body) * (scale or 1)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0 < value <= MAX_DURATION_S):  # also refuses nan, 1e400
        raise _fail("must be a duration such as 3600, 90m, 12h or 7d (at most 3650d)", text)
    return value


def tenant(text: str) -> str:
    """A prefix-cache scope: non-empty, at most 128 characters, no control characters."""
    if not text or len(text) > MAX_TENANT_CHARS or not text.isprintable() or not text.strip():
        raise _fail(f"must be 1..{MAX_TENANT_CHARS} printable characters", text[:40])
    return text


def utf8(text: str) -> str:
    """Text that is valid Unicode: bytes of the command line that were not UTF-8 reach
    Python as lone surrogates, which the tokenizer cannot take."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError("is not valid UTF-8 text") from None
    return text


def non_empty(text: str) -> str:
    """Any non-empty string (e.g. a stop string)."""
    if not text:
        raise argparse.ArgumentTypeError("must not be empty")
    return utf8(text)


def speculate(text: str) -> str:
    """--speculate: off, lookup or draft:MODEL (a model name, dir, .gguf or hub id)."""
    if text in ("off", "lookup") or (text.startswith("draft:") and text[6:].strip()):
        return utf8(text)
    raise _fail("must be off, lookup or draft:MODEL", text[:80])


def lengths(text: str) -> list[int]:
    """'128,1024' -> [128, 1024]: positive integers, de-duplicated, in order."""
    values = [_int(x, "a comma-separated list of positive integers")
              for x in text.split(",") if x.strip()]
    if not values or any(v < 1 for v in values):
        raise _fail("must be a comma-separated list of positive integers", text)
    return list(dict.fromkeys(values))


def regular_file(text: str) -> str:
    """A path that exists and is a regular file: devices, FIFOs and directories are refused.

    Checked with os.stat before anything opens it (opening a FIFO blocks, and a device
    such as /dev/zero never ends); `read_text_file` checks again on the open descriptor.
    """
    try:
        st = os.stat(text)
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot read {text}: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise argparse.ArgumentTypeError(f"not a regular file: {text}")
    return text


def read_file_bytes(path: str, limit: int) -> bytes:
    """At most ``limit`` bytes of a regular file; more, or anything else, is an error.

    Raises ValueError with one line. O_NONBLOCK keeps a FIFO swapped in after the
    os.stat check from blocking the open; fstat then refuses it.
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror}") from None
    try:
        regular = stat.S_ISREG(os.fstat(fd).st_mode)
    except OSError:
        regular = False
    if not regular:
        os.close(fd)
        raise ValueError(f"not a regular file: {path}")
    with os.fdopen(fd, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"{path} is larger than {limit:,} bytes")
    return data


def read_text_file(path: str, limit: int) -> str:
    """At most ``limit`` bytes of a regular UTF-8 file (see `read_file_bytes`)."""
    data = read_file_bytes(path, limit)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not UTF-8 text") from None
