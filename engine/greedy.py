"""Greedy decoding's token choice, exactly mlx-lm's: ``argmax(logits - logsumexp(logits))``.

On MLX's CPU backend the logsumexp costs ~1.3 ms a row for a 49k vocabulary (a scalar
exp per entry): a cost per sequence that batching cannot share, ~1/4 of a batch-8 decode
step. With the CPU extension, `tokens` takes the raw argmax where it provably is the
same token (csrc/greedy.cpp says when) and computes mlx-lm's formula for the other rows.
"""

from __future__ import annotations

import mlx.core as mx


def exact(logits: mx.array) -> mx.array:
    """(rows, vocab) -> (rows,) lazy: the argmax of the log-probs, as mlx-lm's greedy
    sampler takes it (same ties)."""
    return mx.argmax(logits - mx.logsumexp(logits, axis=-1, keepdims=True), axis=-1)


def lazy(logits: mx.array, *, fast: bool) -> mx.array:
    """(rows, vocab) -> (rows,) lazy: `exact`, or (``fast``) the CPU extension's pick,
    -1 where it declines (`settle` those once read)."""
    if not fast:
        return exact(logits)
    from engine.model.cpu_ext.ops import greedy_pick

    return greedy_pick(logits)


def tokens(logits: mx.array, *, fast: bool, wait: tuple = ()) -> list[int]:
    """Each row's greedy token; evaluates ``logits`` and ``wait`` (e.g. the K/V pool) too.

    ``fast``: use the CPU extension's `greedy_pick` (only where it is built)."""
    picked = lazy(logits, fast=fast)
    mx.eval(picked, *wait)
    return settle(picked.tolist(), logits) if fast else picked.tolist()


def settle(picked: list[int], logits: mx.array) -> list[int]:
    """``picked`` (`greedy_pick`'s rows of ``logits``) with each row it declined (-1: a
    near tie or a non-finite row) computed by mlx-lm's formula."""
    unsure = [i for i, t in enumerate(picked) if t < 0]
    if unsure:
        rows = exact(logits[mx.array(unsure)]).tolist()
        for i, t in zip(unsure, rows, strict=True):
            picked[i] = t
    return picked
