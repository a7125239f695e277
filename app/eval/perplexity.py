"""Perplexity of a text through an engine's paged KV pool.

The engine's runner returns the logits of the last position only (all that sampling
needs). Scoring a text needs every position, and the K/V must go through the pool so
that its format (dtype, later quantization) is what the scores measure. `all_logits`
runs the runner's own layers (`PagedModel._attention` writes and reads the pool,
`_mlp`) and projects every position; nothing of attention is copied here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine import Engine  # first: importing engine preloads OpenBLAS before mlx.core

# isort: split
import mlx.core as mx

if TYPE_CHECKING:
    from engine.kvcache.kv_cache import PagedKVCache
    from engine.model.model_runner import PagedModel, StepBatch

SEQ_ID = 1 << 40  # far from the engine's request ids, which count up from 0


def all_logits(runner: PagedModel, batch: StepBatch, kv: PagedKVCache) -> mx.array:
    """(B, L, vocab) logits of every new position (`PagedModel.__call__`'s layers)."""
    return runner._logits(runner.hidden(batch, kv))

@dataclass(slots=True)
class TokenScores:
    """Per predicted token: its negative log-likelihood and the model's top-1 guess."""

    nll: list[float] = field(default_factory=list)
    top1: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.nll)

    @property
    def perplexity(self) -> float:
        return math.exp(sum(self.nll) / self.num_tokens)


def score_text(engine: Engine, ids: list[int], *, chunk: int = 512) -> TokenScores:
    """Teacher-forced scores of ``ids[1:]``, prefilled ``chunk`` tokens at a time.

    The sequence's blocks are taken from the engine's pool and given back at the end;
    call it with no request running (the engine's steps would not know of it).
    """
    from engine.executor import build_batch

    if len(ids) < 2:
        raise ValueError("a text needs at least 2 tokens to be scored")
    if len(ids) > engine.max_context:
        raise ValueError(f"{len(ids)} tokens exceed the context of {engine.max_context}")
    blocks, out = engine.blocks, TokenScores()
    blocks.allocate(SEQ_ID)
    try:
        for start in range(0, len(ids) - 1, chunk):
            piece = ids[start:start + chunk]
            targets = ids[start + 1:start + chunk + 1]  # one fewer in the last chunk
            plan = blocks.append(SEQ_ID, len(piece))
            batch = build_batch(blocks, [SEQ_ID], mx.array([piece], dtype=mx.int32),
                                [plan.slots])
            logits = all_logits(engine.runner, batch, engine.kv)[0, : len(targets)]
            logits = logits.astype(mx.float32)
            logz = mx.logsumexp(logits, axis=-1)
            picked = mx.take_along_axis(logits, mx.array(targets)[:, None], axis=-1)[:, 0]
            nll, top1 = logz - picked, mx.argmax(logits, axis=-1)
            mx.eval(nll, top1, engine.kv.keys, engine.kv.values)
            out.nll += nll.tolist()
            out.top1 += top1.tolist()
    finally:
        blocks.free(SEQ_ID)
    return out


def compare(reference: TokenScores, other: TokenScores) -> dict:
    """Teacher-forced agreement of two runs over the same text."""
    assert reference.num_tokens == other.num_tokens
    n = reference.num_tokens
    same = sum(a == b for a, b in zip(reference.top1, other.top1, strict=True))
    diff = sum(abs(a - b) for a, b in zip(reference.nll, other.nll, strict=True))
    return {"top1_agreement": same / n, "mean_abs_nll_diff": diff / n}
