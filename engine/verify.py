"""Verifying draft tokens: a speculating sequence's decode becomes several decode rows.

A sequence that feeds its last token and ``k`` drafts is ``k + 1`` rows of the step's
batched decode, one per token, each with its own context length (the K/V of all of
them is written before attention reads it, so row ``i`` sees the tokens before it).
Each row is computed exactly as a plain decode of that token would be, so under greedy
decoding the accepted tokens are the tokens plain decoding gives: draft ``i`` is
accepted while it equals the argmax of the row before it; the first row that disagrees
(or the last row) gives one more token of its own. Sampling uses the rejection rule of
speculative sampling for a draft known in advance (a point mass): draft ``d`` is kept
with probability ``p(d)``; on rejection the token is drawn from ``p`` without ``d``,
renormalized, so every token comes from the distribution plain sampling draws from.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from engine.constraint import forbidden
from engine.sampling import SamplingParams


def rows(token: int, draft: list[int], slots: list[int], table: list[int],
         context_len: int) -> list[tuple[int, int, list[int], int]]:
    """(token, slot, block table, context length) per decode row of a sequence whose
    ``1 + len(draft)`` new tokens end at ``context_len``."""
    first = context_len - len(draft)
    return [(t, s, table, first + i)
            for i, (t, s) in enumerate(zip([token, *draft], slots, strict=True))]


def accepted_greedy(draft: list[int], targets: list[int]) -> list[int]:
    """Tokens a greedy step yields: the drafts that equal the argmax before them, then the
    argmax of the first row that disagrees (``targets``: one argmax per row)."""
    n = 0
    while n < len(draft) and draft[n] == targets[n]:
        n += 1
    return draft[:n] + [targets[n]]


def target_logits(params: SamplingParams, logits: mx.array) -> mx.array:
    """(rows, vocab) logits -> what the request's sampler draws from, scaled by its
    temperature (mlx-lm's `make_sampler` chain: top-p, min-p, top-k, then categorical)."""
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    if 0 < params.top_p < 1.0:
        lp = apply_top_p(lp, params.top_p)
    if params.min_p != 0.0:
        lp = apply_min_p(lp, params.min_p, 1)
    if params.top_k > 0:
        lp = apply_top_k(lp, params.top_k)
    return lp * (1.0 / params.temperature)


def accepted_sampled(params: SamplingParams, draft: list[int], logits: mx.array) -> list[int]:
    """Tokens a sampling step yields from ``len(draft) + 1`` rows of logits."""
    scaled = target_logits(params, logits.astype(mx.float32))
    probs = mx.softmax(scaled, axis=-1)
    k = len(draft)
    p_draft = probs[mx.arange(k), mx.array(draft)] if k else mx.zeros((0,))
    u = mx.random.uniform(shape=(k,))
    mx.eval(p_draft, u)
    out: list[int] = []
    for i, d in enumerate(draft):
        if u[i].item() < p_draft[i].item():
            out.append(d)
            continue
        row = scaled[i]  # p without the rejected draft:
        residual = mx.where(mx.arange(row.shape[-1]) == d, -float("inf"), row)
        out.append(int(mx.random.categorical(residual).item()))
        return out
    out.append(int(mx.random.categorical(scaled[k]).item()))
    return out


def masked(logits: mx.array, allowed) -> mx.array:
    """``logits`` rows with what ``allowed`` (bool rows, or None: all) forbids at the
    grammar's forbidden value (`engine.constraint.forbidden`)."""
    if allowed is None:
        return logits
    return mx.where(mx.array(allowed[:, : logits.shape[-1]]), logits, forbidden(logits.dtype))


def draft_masks(reqs) -> tuple[dict[int, np.ndarray], dict[int, Exception]]:
    """The grammar masks of every verify row of the requests with a grammar (computed
    before any token is picked), by request id; and the requests whose matcher failed."""
    masks: dict[int, np.ndarray] = {}
    failed: dict[int, Exception] = {}
    for r in reqs:
        if r.decoder.grammar is not None:
            try:
                masks[r.request_id] = r.decoder.grammar.draft_masks(r.draft)
            except Exception as e:  # noqa: BLE001 - that request fails, alone
                failed[r.request_id] = e
    return masks, failed


def stacked(masks: dict[int, np.ndarray], reqs, vocab: int) -> np.ndarray | None:
    """The masks of ``reqs``' verify rows one under another (all allowed where a request
    has no grammar); None when none has one."""
    if not any(r.request_id in masks for r in reqs):
        return None
    return np.concatenate([masks.get(r.request_id, np.ones((1 + len(r.draft), vocab), bool))
                           for r in reqs])
