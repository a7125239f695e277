"""A draft model for speculative decoding: a smaller model of the same tokenizer that
guesses each speculating sequence's next tokens greedily, over a paged KV pool of its own.

It keeps, per sequence, the tokens whose K/V its pool holds. Before each proposal it
gives back the slots past the longest prefix those share with the sequence's tokens now
(rejected drafts), feeds what is new (at most ``catch_up`` tokens a step: a long prompt
is caught up over several steps, proposing nothing meanwhile), and decodes ``k`` tokens,
all sequences batched in one forward per token. Greedy drafts are a deterministic
function of the context, so the verifier's point-mass rejection rule stays exact.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import mlx.core as mx

from engine import greedy
from engine.config import EngineConfig
from engine.model.loader import LoadedModel
from engine.model.packed_batch import pack
from engine.pacing import ema


def common_prefix(a: list[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share: by slice comparisons (C loops), as a
    sequence's tokens differ from what was fed at most in the last few (rejected drafts),
    and a Python loop over a 2k-token context cost ~0.1 ms a sequence and step."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo]; a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class DraftModel:
    """Proposes drafts with its own model and pool (`propose`); `forget` frees a sequence."""

    def __init__(self, loaded: LoadedModel, *, num_blocks: int, block_size: int,
                 vocab_size: int, catch_up: int = 256):
        from engine.wiring import build_kv

        probe = build_kv(loaded, EngineConfig(kv_budget_bytes=1 << 20, block_size=block_size,
                                              prefix_cache=False, max_running=1))
        if probe.blocks.window is not None:
            raise ValueError("a draft model with sliding-window layers is not supported")
        if probe.runner.embed_tokens.weight.shape[0] < vocab_size:
            raise ValueError("the draft model's vocabulary is smaller than the model's: "
                             "it must use the same tokenizer")
        budget = num_blocks * probe.layout.bytes_per_block
        parts = build_kv(loaded, EngineConfig(kv_budget_bytes=budget, block_size=block_size,
                                              prefix_cache=False))
        self.loaded = loaded
        self.runner, self.kv, self.blocks = parts.runner, parts.kv, parts.blocks
        self.catch_up = catch_up
        self.fed: dict[int, list[int]] = {}  # tokens whose K/V the draft's pool holds
        self.step_s: float | None = None  # measured seconds of one draft forward

    def _sync(self, seq: int, ids: Sequence[int], k: int) -> tuple[list[int], int | None] | None:
        """Give back slots of tokens ``ids`` no longer has; then (tokens to feed without
        logits, the token to decode from: None while a long prompt is still caught up), or
        None when the pool has no room for them and ``k`` drafts."""
        fed = self.fed.get(seq)
        if fed is None:
            self.blocks.allocate(seq, 0)
            fed = self.fed[seq] = []
        keep = min(common_prefix(fed, ids), len(ids) - 1)  # feed at least the last token
        self.blocks.truncate(seq, len(fed) - keep)
        del fed[keep:]
        new = ids[keep:]
        if len(new) > self.catch_up:  # a long prompt: this step's share, no proposal yet
            head, last = new[:self.catch_up], None
        else:
            head, last = new[:-1], new[-1]
        if not self.blocks.can_append(seq, len(head) + (0 if last is None else k)):
            self.forget(seq)
            return None
        return head, last

    def propose(self, seqs: list[tuple[int, Sequence[int]]], k: int) -> dict[int, list[int]]:
        """Up to ``k`` greedy draft tokens for each (sequence id, token ids)."""
        t = time.perf_counter()
        prefills, decodes, order = [], [], []
        for seq, ids in seqs:
            fed = self._sync(seq, ids, k)
            if fed is None:
                continue
            head, last = fed
            if head:
                plan = self.blocks.append(seq, len(head))
                prefills.append((head, plan.slots, self.blocks.block_tables[seq],
                                 self.blocks.num_tokens[seq]))
                self.fed[seq] += head
            if last is not None:
                plan = self.blocks.append(seq, 1)
                decodes.append((last, plan.slots[0], self.blocks.block_tables[seq],
                                self.blocks.num_tokens[seq]))
                self.fed[seq].append(last)
                order.append(seq)
        drafts: dict[int, list[int]] = {s: [] for s in order}
        if not prefills and not decodes:
            return drafts
        logits = self.runner.forward_packed(pack(prefills, decodes), self.kv)
        steps = 1
        while order:
            picked = greedy.exact(logits)
            mx.eval(picked, *self.kv.arrays)
            for seq, tok in zip(order, picked.tolist(), strict=True):
                drafts[seq].append(tok)
            if len(drafts[order[0]]) >= k:
                break
            rows = []
            for seq in order:
                plan = self.blocks.append(seq, 1)
                rows.append((drafts[seq][-1], plan.slots[0], self.blocks.block_tables[seq],
                             self.blocks.num_tokens[seq]))
                self.fed[seq].append(drafts[seq][-1])
            logits = self.runner.forward_packed(pack([], rows), self.kv)
            steps += 1
        if not order:
            mx.eval(*self.kv.arrays)
        self.step_s = ema(self.step_s, (time.perf_counter() - t) / steps)
        return drafts

    def forget(self, seq: int) -> None:
        self.blocks.free(seq)
        self.fed.pop(seq, None)
