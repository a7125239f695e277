"""A step's plan as int32 arrays: what rank 0 tells the other ranks, and how they read it.

Every message is a fixed header, then one int32 body (the block-ledger delta, then the op's
payload), then optionally one tensor (hidden states or logits). The header gives the sizes
and the tensor's shape and dtype, so a receiver always knows what `mx.distributed.recv` to
post next: the ring backend has no message framing of its own.

Batches travel as their int32 fields only (token ids, positions, slots, block tables,
context lengths); every rank rebuilds the very `StepBatch` / `PackedBatch` rank 0 runs, so
each writes its K/V into the same slots and attends over the same block tables.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

import mlx.core as mx
import numpy as np

from engine.model.model_runner import StepBatch
from engine.model.packed_batch import PackedBatch, Segment

HEADER_LEN = 12
MAGIC = 0x6B7663  # "kvc": a stray or misaligned message is an error, never a plan
DTYPES = (mx.int32, mx.float32, mx.float16, mx.bfloat16)


class Op(IntEnum):
    """What a message asks of a rank."""

    HELLO = 1  # rank 0's pool layout; each rank checks it can hold the same blocks
    STEP = 2  # a `StepBatch` forward (prefill chunk or decode batch)
    PACKED = 3  # a `PackedBatch` forward (mixed step)
    COPY = 4  # copy-on-write: copy whole blocks src -> dst
    REPORT = 5  # each rank appends its pool accounting
    STOP = 6  # REPORT, then the rank exits
    REPLY = 7  # the last rank's answer to rank 0
    PERSIST = 8  # write these blocks' K/V to each rank's disk store (no reply)
    RESTORE_CHECK = 9  # how many of these blocks can every rank read from its store?
    RESTORE_COMMIT = 10  # put the blocks just read into these block ids (no reply)


@dataclass(slots=True)
class Message:
    """One message: op, a sequence number, the ledger delta, the payload, a tensor."""

    op: Op
    seq: int
    payload: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    ledger: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    tensor: mx.array | None = None

    def header(self) -> np.ndarray:
        h = np.zeros(HEADER_LEN, np.int32)
        h[:5] = MAGIC, int(self.op), self.seq, len(self.ledger), len(self.payload)
        if self.tensor is not None:
            shape = self.tensor.shape
            if len(shape) > 3:
                raise ValueError(f"a message tensor has at most 3 dims, got {shape}")
            h[5] = len(shape)
            h[6:6 + len(shape)] = shape
            h[9] = DTYPES.index(self.tensor.dtype)
        return h

    def body(self) -> np.ndarray:
        return np.concatenate([self.ledger, self.payload]).astype(np.int32)


@dataclass(slots=True)
class Header:
    """A parsed header: what follows it on the wire."""

    op: Op
    seq: int
    ledger_len: int
    payload_len: int
    tensor_shape: tuple[int, ...] | None
    tensor_dtype: mx.Dtype | None


def parse_header(h: np.ndarray) -> Header:
    """Check the magic and read the sizes; a bad header means the ranks are out of step."""
    if h.shape != (HEADER_LEN,) or int(h[0]) != MAGIC:
        raise ValueError("distributed message out of step (bad header): ranks disagree on "
                         "the protocol")
    ndim = int(h[5])
    shape = tuple(int(d) for d in h[6:6 + ndim]) if ndim else None
    return Header(Op(int(h[1])), int(h[2]), int(h[3]), int(h[4]), shape,
                  DTYPES[int(h[9])] if ndim else None)


class _Writer:
    def __init__(self):
        self.parts: list[np.ndarray] = []

    def ints(self, *values) -> None:
        self.parts.append(np.asarray(values, np.int32))

    def array(self, a) -> None:
        self.parts.append(np.asarray(a, np.int32).reshape(-1))

    def done(self) -> np.ndarray:
        return np.concatenate(self.parts) if self.parts else np.zeros(0, np.int32)


class _Reader:
    def __init__(self, a: np.ndarray):
        self.a, self.i = a, 0

    def take(self, n: int) -> np.ndarray:
        out = self.a[self.i:self.i + n]
        if len(out) != n:
            raise ValueError("distributed plan truncated")
        self.i += n
        return out

    def int(self) -> int:
        return int(self.take(1)[0])


def _np(a: mx.array) -> np.ndarray:
    return np.asarray(a.astype(mx.int32))


def encode_step(batch: StepBatch, logits: bool) -> np.ndarray:
    """A `StepBatch` (and whether its logits are wanted) as int32s."""
    B, L = batch.input_ids.shape
    W = batch.block_tables.shape[1]
    w = _Writer()
    w.ints(B, L, W, -1 if batch.block_run is None else batch.block_run, int(logits))
    for a in (batch.input_ids, batch.offsets, batch.slots, batch.block_tables):
        w.array(_np(a))
    w.array(batch.context_lens)
    return w.done()


def decode_step(payload: np.ndarray) -> tuple[StepBatch, bool]:
    r = _Reader(payload)
    B, L, W, run, logits = (r.int() for _ in range(5))
    ids = mx.array(r.take(B * L).reshape(B, L))
    offsets = mx.array(r.take(B))
    slots = mx.array(r.take(B * L))
    tables = mx.array(r.take(B * W).reshape(B, W))
    lens = [int(n) for n in r.take(B)]
    return StepBatch(ids, offsets, slots, tables, lens, None if run < 0 else run), bool(logits)


def encode_packed(batch: PackedBatch) -> np.ndarray:
    """A `PackedBatch` as int32s: sizes, token rows, segments, then the decode tables."""
    T = batch.num_tokens
    D = len(batch.decode_lens)
    W = batch.decode_tables.shape[1] if batch.decode_tables is not None else 0
    w = _Writer()
    w.ints(T, len(batch.prefills), D, W, batch.decode_start)
    for a in (batch.input_ids, batch.positions, batch.slots):
        w.array(_np(a))
    for seg in batch.prefills:
        table = _np(seg.block_table).reshape(-1)
        w.ints(seg.start, seg.length, seg.context_len,
               -1 if seg.block_run is None else seg.block_run, len(table))
        w.array(table)
    if D:
        w.array(_np(batch.decode_tables))
        w.array(batch.decode_lens)
    return w.done()


def decode_packed(payload: np.ndarray) -> PackedBatch:
    r = _Reader(payload)
    T, n_seg, D, W, decode_start = (r.int() for _ in range(5))
    ids = mx.array(r.take(T).reshape(1, T))
    positions = mx.array(r.take(T))
    slots = mx.array(r.take(T))
    segments = []
    for _ in range(n_seg):
        start, length, ctx, run, nb = (r.int() for _ in range(5))
        table = mx.array(r.take(nb).reshape(1, nb))
        segments.append(Segment(start, length, ctx, table, None if run < 0 else run))
    tables, lens = None, []
    if D:
        tables = mx.array(r.take(D * W).reshape(D, W))
        lens = [int(n) for n in r.take(D)]
    return PackedBatch(ids, positions, slots, segments, decode_start, tables, lens)


def encode_copies(copies: list[tuple[int, int]]) -> np.ndarray:
    return np.asarray(copies, np.int32).reshape(-1)


def decode_copies(payload: np.ndarray) -> list[tuple[int, int]]:
    pairs = payload.reshape(-1, 2)
    return [(int(s), int(d)) for s, d in pairs]


def encode_text(text: str) -> np.ndarray:
    """A string as int32 code points (fingerprints and error messages in a handshake)."""
    return np.asarray([len(text)] + [ord(c) for c in text], np.int32)


def decode_text(r: np.ndarray, at: int = 0) -> tuple[str, int]:
    """(the string at ``at``, the index after it)."""
    n = int(r[at])
    return "".join(chr(int(c)) for c in r[at + 1:at + 1 + n]), at + 1 + n
