"""The file format of one disk prefix-store entry (one KV block).

Layout, integers little-endian::

    b"KVCB" | version: u16 | header_len: u32 | header: JSON (utf-8) | payload | sha256: 32 bytes

The checksum covers every byte before it. The header holds the salt's parts, the block and
parent hashes, the token ids, created / expires (unix seconds) and each tensor's dtype and
shape; the payload is the tensors' raw bytes back to back in header order (C order).
numpy has no bfloat16, so bfloat16 tensors travel as their uint16 bit patterns: a uint16
array handed to `write_entry` is recorded as "bfloat16" and read back as uint16.

Decoding never trusts the file: anything unexpected raises `EntryError` with a reason
("corrupt" or "old_format"), never another exception.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import secrets
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from engine.kvcache.prefix_key import HASH_SIZE, CacheSalt

MAGIC = b"KVCB"
FORMAT_VERSION = 1
PREFIX = struct.Struct("<4sHI")
DIGEST_SIZE = 32
TEMP_SUFFIX = ".tmp"
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
# Bounds garbage: a header is a few KiB, so a bigger length means the file is not ours.
_MAX_HEADER = 1 << 20
# header dtype name -> how the bytes are stored
DTYPES = {"float32": np.dtype("<f4"), "float16": np.dtype("<f2"), "bfloat16": np.dtype("<u2")}
_NAME_OF = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16",
            np.dtype(np.uint16): "bfloat16"}


class EntryError(Exception):
    """A file that must not be served; ``reason`` is the miss counter it feeds."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass(slots=True)
class EntryHeader:
    """The parsed JSON header of an entry."""

    salt: CacheSalt
    block_hash: bytes
    parent_hash: bytes
    token_ids: list[int]
    created: float
    expires: float
    tensors: list[tuple[str, tuple[int, ...]]]  # (dtype name, shape) per payload tensor

    @property
    def payload_bytes(self) -> int:
        return sum(DTYPES[d].itemsize * math.prod(shape) for d, shape in self.tensors)

    def to_json(self) -> bytes:
        doc = {
            "salt": self.salt.to_dict(),
            "block_hash": self.block_hash.hex(),
            "parent_hash": self.parent_hash.hex(),
            "token_ids": self.token_ids,
            "created": self.created,
            "expires": self.expires,
            "tensors": [{"dtype": d, "shape": list(s)} for d, s in self.tensors],
        }
        return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()

    def file_size(self) -> int:
        """Bytes of the whole entry file this header describes."""
        return PREFIX.size + len(self.to_json()) + self.payload_bytes + DIGEST_SIZE


def dtype_name(a: np.ndarray) -> str:
    """The header name of an array's dtype (uint16 means bfloat16 bits)."""
    try:
        return _NAME_OF[a.dtype.newbyteorder("=")]
    except KeyError:
        msg = f"unsupported KV dtype {a.dtype} (float32, float16, uint16=bfloat16)"
        raise ValueError(msg) from None


def write_entry(
    f: BinaryIO, header: EntryHeader, arrays: Sequence[np.ndarray], *, version: int = FORMAT_VERSION
) -> None:
    """Write one entry to ``f``; ``version`` exists so tests can forge other formats."""
    digest = hashlib.sha256()

    def out(chunk) -> None:
        digest.update(chunk)
        f.write(chunk)

    raw = header.to_json()
    out(PREFIX.pack(MAGIC, version, len(raw)))
    out(raw)
    for (name, _), a in zip(header.tensors, arrays, strict=True):
        out(memoryview(np.ascontiguousarray(a, dtype=DTYPES[name])).cast("B"))
    f.write(digest.digest())


def _hash_field(value) -> bytes:
    if not isinstance(value, str) or len(value) != 2 * HASH_SIZE:
        raise ValueError("bad hash")
    return bytes.fromhex(value)


def _time_field(value) -> float:
    if type(value) not in (int, float) or not math.isfinite(value):
        raise ValueError("bad timestamp")
    return float(value)


def _int_list(value, *, min_value: int) -> list[int]:
    if not isinstance(value, list) or any(type(v) is not int or v < min_value for v in value):
        raise ValueError("bad int list")
    return value


def parse_header(raw: bytes) -> EntryHeader:
    """Parse and type-check a JSON header; raises `EntryError("corrupt")`."""
    try:
        doc = json.loads(raw.decode("utf-8"))
        tensors = []
        for t in doc["tensors"]:
            if t["dtype"] not in DTYPES:
                raise ValueError("bad dtype")
            tensors.append((t["dtype"], tuple(_int_list(t["shape"], min_value=0))))
        return EntryHeader(
            salt=CacheSalt.from_dict(doc["salt"]),
            block_hash=_hash_field(doc["block_hash"]),
            parent_hash=_hash_field(doc["parent_hash"]),
            token_ids=_int_list(doc["token_ids"], min_value=-(1 << 31)),
            created=_time_field(doc["created"]),
            expires=_time_field(doc["expires"]),
            tensors=tensors,
        )
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as e:
        raise EntryError("corrupt", f"header: {e}") from None


def _check_prefix(prefix: bytes) -> int:
    if len(prefix) < PREFIX.size:
        raise EntryError("corrupt", "short file")
    magic, version, header_len = PREFIX.unpack_from(prefix)
    if magic != MAGIC:
        raise EntryError("corrupt", "bad magic")
    if version != FORMAT_VERSION:
        raise EntryError("old_format", f"format version {version}")
    if header_len > _MAX_HEADER:
        raise EntryError("corrupt", "header too long")
    return header_len


def read_header(f: BinaryIO, file_size: int) -> EntryHeader:
    """Read only the prefix and header (start-up scans skip the payload).

    Checks magic, version, header and the file size the header implies (catches truncation);
    the checksum is left to `decode_entry`.
    """
    header_len = _check_prefix(f.read(PREFIX.size))
    raw = f.read(header_len)
    if len(raw) != header_len:
        raise EntryError("corrupt", "short header")
    header = parse_header(raw)
    if file_size != PREFIX.size + header_len + header.payload_bytes + DIGEST_SIZE:
        raise EntryError("corrupt", "file size does not match header")
    return header


def decode_entry(data: bytearray) -> tuple[EntryHeader, list[np.ndarray]]:
    """Verify a whole entry file and return its header and tensors (views into ``data``)."""
    header_len = _check_prefix(bytes(data[: PREFIX.size]))
    start = PREFIX.size + header_len
    if len(data) < start + DIGEST_SIZE:
        raise EntryError("corrupt", "short file")
    view = memoryview(data)
    if hashlib.sha256(view[:-DIGEST_SIZE]).digest() != bytes(view[-DIGEST_SIZE:]):
        raise EntryError("corrupt", "checksum")
    header = parse_header(bytes(view[PREFIX.size : start]))
    if len(data) != start + header.payload_bytes + DIGEST_SIZE:
        raise EntryError("corrupt", "payload size does not match shapes")
    arrays, offset = [], start
    for name, shape in header.tensors:
        dtype, count = DTYPES[name], math.prod(shape)
        arrays.append(np.frombuffer(data, dtype, count, offset).reshape(shape))
        offset += count * dtype.itemsize
    return header, arrays


def write_temp(path: Path, header: EntryHeader, arrays: Sequence[np.ndarray]) -> Path:
    """Write the entry for ``path`` to a fresh temp file beside it, durable and mode 0600.

    The caller renames it into place (`os.replace`) and fsyncs the directory; until then a
    crash leaves only a temp file, which readers never open. Returns the temp path.
    """
    tmp = path.with_name(f".{path.stem}.{secrets.token_hex(6)}{TEMP_SUFFIX}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600)
    try:
        with open(fd, "wb") as f:
            os.fchmod(fd, 0o600)  # exact mode whatever the umask
            write_entry(f, header, arrays)
            f.flush()
            os.fsync(fd)
        # mtime is the store's "last used"; start it at the entry's creation
        os.utime(tmp, (header.created, header.created))
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def read_file(path: Path, max_bytes: int) -> tuple[bytearray | None, os.stat_result]:
    """The bytes of an entry file (None if over ``max_bytes``) and its stat; never follows links.

    Raises:
        OSError: FileNotFoundError when absent, others on I/O errors.
    """
    with open(path, "rb", opener=nofollow) as f:
        st = os.fstat(f.fileno())
        if st.st_size > max_bytes:
            return None, st  # no valid entry is this big: don't read garbage into memory
        data = bytearray(st.st_size)
        return (data if f.readinto(data) == st.st_size else None), st


def nofollow(path, flags: int) -> int:
    """`open` opener refusing symlinks."""
    return os.open(path, flags | _NOFOLLOW)


def fsync_dir(path: Path) -> None:
    """Make renames in ``path`` durable; best effort (some filesystems refuse)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
