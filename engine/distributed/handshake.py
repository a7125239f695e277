"""The start of a run: rank 0 tells every rank its pool's format and size, each checks it.

Every rank must hold the same block ids in the same format, and must have loaded the same
model: rank 0 sends the whole model's fingerprint, the parallel mode, the number of blocks
and the KV format; each rank answers whether it agrees (and why not), so a mismatch ends
the run at once with a message that names it, never with wrong tokens later.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.distributed import plan_wire as wire
from engine.distributed.config import MODES
from engine.errors import KVChatError
from engine.kvcache.kv_cache import KVLayout
from engine.kvcache.quant import QuantSpec


@dataclass(slots=True)
class Hello:
    """What rank 0 sends: the run's shape and its pool's format."""

    mode: str
    world: int
    num_blocks: int
    layout: KVLayout  # rank 0's (its layer count and KV heads are its own)
    use_kernels: bool
    model_fingerprint: str  # the whole model's, before any rank cut it
    disk: bool = False  # rank 0 has a disk prefix store: every rank opens its own


HEAD = 16  # int32 fields before the fingerprint


def _quant(q: QuantSpec | None) -> tuple[int, int]:
    return (q.bits, q.group_size) if q else (0, 0)


def encode_hello(h: Hello) -> np.ndarray:
    L = h.layout
    head = [MODES.index(h.mode), h.world, h.num_blocks, L.block_size,
            wire.DTYPES.index(L.dtype), *_quant(L.k_quant), *_quant(L.v_quant), L.head_dim,
            int(h.use_kernels), int(h.disk),
            *(q.rotation if q else 0 for q in (L.k_quant, L.v_quant)),
            int(L.residual), int(L.key_channel)]
    return np.concatenate([np.asarray(head, np.int32), wire.encode_text(h.model_fingerprint)])


def decode_hello(payload: np.ndarray) -> tuple[Hello, int]:
    """(the hello, where the ranks' answers start in the payload)."""
    v = [int(x) for x in payload[:HEAD]]
    fingerprint, end = wire.decode_text(payload, HEAD)
    k = QuantSpec(v[5], v[6], v[12]) if v[5] else None
    vq = QuantSpec(v[7], v[8], v[13]) if v[7] else None
    layout = KVLayout(0, 0, v[9], v[3], wire.DTYPES[v[4]], k, vq, residual=bool(v[14]),
                      key_channel=bool(v[15]))
    return Hello(MODES[v[0]], v[1], v[2], layout, bool(v[10]), fingerprint, bool(v[11])), end


def check(hello: Hello, *, world: int, mode: str, fingerprint: str, head_dim: int) -> str:
    """Why this rank cannot take part ("" when it can)."""
    if hello.world != world or hello.mode != mode:
        return (f"rank 0 runs {hello.mode} parallel over {hello.world} ranks, this rank "
                f"{mode} over {world}")
    if fingerprint != hello.model_fingerprint:
        return (f"another model or weight format than rank 0's (fingerprint "
                f"{fingerprint[:12]} vs {hello.model_fingerprint[:12]}): load the same "
                "model with the same --weights on every rank")
    if head_dim != hello.layout.head_dim:
        return f"head dim {head_dim} differs from rank 0's {hello.layout.head_dim}"
    return ""


def answer(payload: np.ndarray, rank: int, error: str) -> np.ndarray:
    """``payload`` with this rank's answer appended: rank, then the error text."""
    return np.concatenate([payload, np.asarray([rank], np.int32), wire.encode_text(error)])


def refusals(payload: np.ndarray, start: int) -> list[str]:
    """Every rank's refusal in an answered hello; empty when all agreed."""
    out, i = [], start
    while i < len(payload):
        rank = int(payload[i])
        error, i = wire.decode_text(payload, i + 1)
        if error:
            out.append(f"rank {rank}: {error}")
    return out


def raise_refusals(payload: np.ndarray, start: int) -> None:
    """Raises:
    KVChatError: one or more ranks refused."""
    bad = refusals(payload, start)
    if bad:
        raise KVChatError("the ranks disagree: " + "; ".join(bad))
