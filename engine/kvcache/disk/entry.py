"""The file format of one disk prefix-store entry (one KV block).

Layout, integers little-endian::

    b"KVCB" | version: u16 | header_len: u32 | header: JSON (utf-8) | payload | sha256: 32 bytes

The checksum covers every byte before it. The header holds the salt's parts, the block and
parent hashes, the token ids, created / expires (unix seconds), the block's full KV format and
geometry (`spec.EntrySpec`: compute dtype, K and V each plain or bits + group size, residual
and per-channel keys) and
each tensor's dtype and shape; the payload is the tensors' raw bytes back to back in header
order (C order): the pool's stored bytes, packed data, scales and biases of a quantized side
included, so a block comes back exactly as it was. bfloat16 travels as uint16 bit patterns.

Version 2 added the format (version 1 held float blocks only); other versions are misses.

Decoding never trusts the file: anything unexpected raises `EntryError` with a reason
("corrupt" or "old_format"), never another exception. A checksum proves only that the bytes
are the ones written, so `check_entry` then checks them against what the reader asked for
(salt, block, token ids, format and geometry: `EntrySpec`).
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np

from engine.kvcache.disk.spec import DTYPES, EntrySpec, dtype_name
from engine.kvcache.prefix_key import HASH_SIZE, CacheSalt, chain_hash

__all__ = ["DTYPES", "EntryError", "EntryHeader", "EntrySpec", "check_entry", "check_structure",
           "checksum_ok", "decode_entry", "dtype_name", "make_header", "parse_header",
           "read_header", "write_entry"]

MAGIC = b"KVCB"
FORMAT_VERSION = 2  # 2: the header records the KV format; quantized blocks (1: float only)
PREFIX = struct.Struct("<4sHI")
DIGEST_SIZE = 32
# Token ids are hashed as int32 (`prefix_key.chain_hash`); vocabularies are far smaller.
TOKEN_ID_LIMIT = 1 << 31
# Bounds garbage: a header is a few KiB, so a bigger length means the file is not ours.
_MAX_HEADER = 1 << 20


class EntryError(Exception):
    """A file that must not be served; ``reason`` is the miss counter it feeds, ``inode``
    the file judged (if known: the reader deletes only that one)."""

    def __init__(self, reason: str, detail: str = "", inode: int | None = None):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason, self.inode = reason, inode


@dataclass(slots=True)
class EntryHeader:
    """The parsed JSON header of an entry."""

    salt: CacheSalt
    block_hash: bytes
    parent_hash: bytes
    token_ids: list[int]
    created: float
    expires: float
    spec: EntrySpec  # the block's KV format and geometry: what the tensors must be
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
            "spec": self.spec.to_dict(),
            "tensors": [{"dtype": d, "shape": list(s)} for d, s in self.tensors],
        }
        return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()

    def file_size(self) -> int:
        """Bytes of the whole entry file this header describes."""
        return PREFIX.size + len(self.to_json()) + self.payload_bytes + DIGEST_SIZE


def make_header(salt: CacheSalt, block_hash: bytes, parent_hash: bytes,
                token_ids: Sequence[int], arrays: Sequence[np.ndarray], created: float,
                ttl_s: float, spec: EntrySpec | None = None) -> EntryHeader:
    """The header for writing a block: only one that `check_entry` will accept.

    ``arrays`` are the block's tensors in `EntrySpec.tensors` order; ``spec`` defaults to
    `EntrySpec.infer` (plain float blocks only).

    Raises:
        ValueError: arrays not numpy, a block `check_structure` refuses (arrays that are
            not what ``spec`` says, a format that is not the salt's), or ``block_hash``
            not ``chain_hash(parent_hash, token_ids)``.
    """
    if not all(isinstance(a, np.ndarray) for a in arrays):
        raise ValueError("arrays must be numpy (heads, block_size, dim)")
    spec = EntrySpec.infer(arrays) if spec is None else spec
    tokens = [int(t) for t in token_ids]
    header = EntryHeader(salt, bytes(block_hash), bytes(parent_hash), tokens, created,
                         created + ttl_s, spec, [(dtype_name(a), tuple(a.shape)) for a in arrays])
    try:
        check_structure(header)
    except EntryError as e:
        raise ValueError(f"not a block of this salt: {e}") from None
    if len(block_hash) != HASH_SIZE or chain_hash(parent_hash, tokens) != block_hash:
        raise ValueError("block_hash is not chain_hash(parent_hash, token_ids)")
    return header


def write_entry(f: BinaryIO, header: EntryHeader, arrays: Sequence[np.ndarray], *,
                version: int = FORMAT_VERSION) -> None:
    """Write one entry to ``f``; ``version`` exists so tests can forge other formats."""
    digest = hashlib.sha256()

    def out(chunk) -> None:
        digest.update(chunk)
        f.write(chunk)

    raw = header.to_json()
    out(PREFIX.pack(MAGIC, version, len(raw)))
    out(raw)
    for (name, _), a in zip(header.tensors, arrays, strict=True):
        out(np.ascontiguousarray(a, dtype=DTYPES[name]).reshape(-1).view(np.uint8))
    f.write(digest.digest())


def _hash_field(value) -> bytes:
    if not isinstance(value, str) or len(value) != 2 * HASH_SIZE:
        raise ValueError("bad hash")
    return bytes.fromhex(value)


def _time_field(value) -> float:
    if type(value) not in (int, float) or not math.isfinite(value):
        raise ValueError("bad timestamp")
    return float(value)


def _int_list(value, *, min_value: float) -> list[int]:
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
            token_ids=_int_list(doc["token_ids"], min_value=-math.inf),  # range: `check_structure`
            created=_time_field(doc["created"]),
            expires=_time_field(doc["expires"]),
            spec=EntrySpec.from_dict(doc["spec"]),
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


def checksum_ok(data: bytearray) -> bool:
    """Whether the last `DIGEST_SIZE` bytes are the SHA-256 of all before them."""
    view = memoryview(data)
    return (len(data) >= DIGEST_SIZE
            and hashlib.sha256(view[:-DIGEST_SIZE]).digest() == bytes(view[-DIGEST_SIZE:]))


def decode_entry(data: bytearray, checked: bool | None = None
                 ) -> tuple[EntryHeader, list[np.ndarray]]:
    """Verify a whole entry file and return its header and tensors (views into ``data``);
    ``checked`` is `checksum_ok` of these very bytes when it was computed ahead (a reader
    thread), None to compute it here."""
    header_len = _check_prefix(bytes(data[: PREFIX.size]))
    start = PREFIX.size + header_len
    if len(data) < start + DIGEST_SIZE:
        raise EntryError("corrupt", "short file")
    if not (checksum_ok(data) if checked is None else checked):
        raise EntryError("corrupt", "checksum")
    view = memoryview(data)
    header = parse_header(bytes(view[PREFIX.size : start]))
    if len(data) != start + header.payload_bytes + DIGEST_SIZE:
        raise EntryError("corrupt", "payload size does not match shapes")
    arrays, offset = [], start
    for name, shape in header.tensors:
        dtype, count = DTYPES[name], math.prod(shape)
        arrays.append(np.frombuffer(data, dtype, count, offset).reshape(shape))
        offset += count * dtype.itemsize
    return header, arrays


def check_structure(header: EntryHeader, expect: EntrySpec | None = None) -> None:
    """Check what the salt and the header's spec imply, and ``expect`` if given; raises
    `EntryError("malformed")`.

    Always: a full block of token ids in ``[0, 2**31)``, a spec whose format is the salt's
    ``kv_format``, and exactly the tensors (count, order, dtypes, shapes) that spec implies
    for the salt's block size. With ``expect``: the header's spec is exactly it.
    """
    salt, spec, tensors = header.salt, header.spec, header.tensors
    if len(header.token_ids) != salt.block_size:
        raise EntryError("malformed", f"{len(header.token_ids)} token ids in a block")
    if any(not 0 <= t < TOKEN_ID_LIMIT for t in header.token_ids):
        raise EntryError("malformed", "token id out of range")
    if spec.kv_format != salt.kv_format:
        raise EntryError("malformed", f"a {spec.kv_format} block under a {salt.kv_format} salt")
    if spec.key_channel not in (0, salt.block_size):  # a key group is exactly one block
        raise EntryError("malformed", f"key channels over {spec.key_channel} tokens in blocks "
                                      f"of {salt.block_size}")
    # the count first: a forged spec must not make us build a huge list
    if len(tensors) != spec.num_tensors:
        raise EntryError("malformed", f"{len(tensors)} tensors, expected {spec.num_tensors}")
    for i, (got, want) in enumerate(zip(tensors, spec.tensors(salt.block_size), strict=True)):
        if got != want:
            raise EntryError("malformed", f"tensor {i}: {got[0]}{got[1]}, expected "
                                          f"{want[0]}{want[1]}")
    if expect is not None and spec != expect:
        raise EntryError("malformed", f"a block of {spec}, expected {expect}")


def check_entry(header: EntryHeader, salt: CacheSalt, block_hash: bytes,
                token_ids: Sequence[int], expect: EntrySpec | None = None) -> None:
    """Check a decoded entry against the block the reader asked for (all but expiry).

    Raises:
        EntryError: "foreign" (another salt), "malformed" (`check_structure`), "corrupt"
            (hashes that do not chain) or "mismatch" (other token ids: a hash collision).
    """
    if header.salt != salt:
        raise EntryError("foreign")
    check_structure(header, expect)
    if header.block_hash != block_hash:
        raise EntryError("corrupt", "block hash")
    if chain_hash(header.parent_hash, header.token_ids) != block_hash:
        raise EntryError("corrupt", "chain hash")
    if header.token_ids != [int(t) for t in token_ids]:
        raise EntryError("mismatch")
