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
    """Per predicted token: its negative log-likelihood and the model's top-1 guess; with a
    reference, KL(reference || this) of the next-token distributions; for a run kept as
    the reference, its log-probabilities (float16, one (n, vocab) array per chunk)."""

    nll: list[float] = field(default_factory=list)
    top1: list[int] = field(default_factory=list)
    kl: list[float] = field(default_factory=list)
    logprobs: list = field(default_factory=list, repr=False)

    @property
    def num_tokens(self) -> int:
        return len(self.nll)

    @property
    def perplexity(self) -> float:
        return math.exp(sum(self.nll) / self.num_tokens)


KL_TOP = 256  # reference probabilities kept per position; the rest as one tail bucket


def top_logprobs(logp: mx.array) -> tuple[mx.array, mx.array]:
    """(ids, log-probabilities) of each row's `KL_TOP` likeliest tokens, float32."""
    ids = mx.argpartition(-logp, KL_TOP - 1, axis=-1)[:, :KL_TOP]
    vals = mx.take_along_axis(logp, ids, axis=-1)
    mx.eval(ids, vals)
    return ids, vals


def kl_divergence(reference: tuple[mx.array, mx.array], logp: mx.array) -> mx.array:
    """KL(reference || p) per row over the reference's top tokens plus one bucket for the
    rest: a lower bound of the full KL (coarser outcomes never raise it), tight when the
    bucket's mass is small (at top-256 of a 49k vocabulary, ~1e-3 or less here)."""
    ids, ref = reference
    q = mx.take_along_axis(logp, ids, axis=-1)
    p = mx.exp(ref)
    p_tail = mx.maximum(1.0 - p.sum(axis=-1), 0.0)
    q_tail = mx.maximum(1.0 - mx.exp(q).sum(axis=-1), 1e-30)
    tail = mx.where(p_tail > 0, p_tail * (mx.log(mx.maximum(p_tail, 1e-30)) - mx.log(q_tail)), 0.0)
    return (p * (ref - q)).sum(axis=-1) + tail


def score_text(engine: Engine, ids: list[int], *, chunk: int = 512,
               reference: TokenScores | None = None, keep: bool = False) -> TokenScores:
    """Teacher-forced scores of ``ids[1:]``, prefilled ``chunk`` tokens at a time.

    ``keep`` keeps the log-probabilities (the reference run); ``reference``, a kept run of
    the same text and chunking, adds KL(reference || this run) at every position.
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
            logp = logits - logz[:, None]
            kl = None if reference is None else kl_divergence(reference.logprobs[start // chunk],
                                                              logp)
            mx.eval(nll, top1, *engine.kv.arrays, *([kl] if kl is not None else []))
            out.nll += nll.tolist()
            out.top1 += top1.tolist()
            if kl is not None:
                out.kl += kl.tolist()
            if keep:
                out.logprobs.append(top_logprobs(logp))
    finally:
        blocks.free(SEQ_ID)
    return out


def compare(reference: TokenScores, other: TokenScores) -> dict:
    """Teacher-forced agreement of two runs over the same text."""
    assert reference.num_tokens == other.num_tokens
    n = reference.num_tokens
    same = sum(a == b for a, b in zip(reference.top1, other.top1, strict=True))
    diff = sum(abs(a - b) for a, b in zip(reference.nll, other.nll, strict=True))
    out = {"top1_agreement": same / n, "mean_abs_nll_diff": diff / n}
    if other.kl:
        out["kl_mean"] = sum(other.kl) / n
    return out
