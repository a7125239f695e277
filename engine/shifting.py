"""Context shift: one generation runs past the context by dropping its middle.

Opt-in per request (`SamplingParams.context_shift`, default `EngineConfig.context_shift`).
When a decoding sequence holds as many tokens as it may (the context, or the pool if that
is smaller), the scheduler asks `make_room` before planning its step: the first
``shift_sinks`` tokens (rounded up to whole blocks, StreamingLLM's attention sinks) stay,
half of the blocks after them go (`kvcache.context_shift`), and the keys of the blocks
that close up behind the sinks are re-rotated to their new positions in place
(`model.rope_shift`). New tokens then take positions after the shifted cache, since
positions come from the block manager's token count.

The request keeps every token it produced (`all_ids`: the text, stop strings, penalties);
``num_dropped`` tokens after the sinks are out of its cache (`Request.kv_ids`), and
``num_computed`` counts cache tokens. A recompute after preemption prefills ``kv_ids``.
A shifted sequence's prefix stops being registered (``SeqPrefix.frozen``) and its moved
blocks lose their prefix names; speculation skips it (its drafts would have to cross the
shift, and a draft model's own cache holds the unshifted tokens).
"""

from __future__ import annotations

from engine.errors import KVChatError, OutOfBlocksError, RequestError
from engine.kvcache import context_shift
from engine.kvcache.block_manager import BlockManager
from engine.kvcache.kv_cache import PagedKVCache
from engine.model.rope_shift import KeyShifter, refusal
from engine.request import Request


class ContextShifter:
    """Decides and performs context shifts of running requests."""

    def __init__(self, runner, kv: PagedKVCache, blocks: BlockManager, max_context: int, *,
                 default: bool = False, sink_tokens: int = 4):
        self.blocks = blocks
        self.default = default
        why = refusal(runner)
        self.keys = KeyShifter(runner, kv) if why is None else None
        self.refusal: str | None = None
        self.refuse(why)
        self.sink_blocks = blocks.blocks_needed(sink_tokens)
        # tokens one sequence may hold: the context, or the pool when it is smaller
        self.cap = min(max_context, blocks.num_blocks * blocks.block_size)

    def refuse(self, reason: str | None) -> None:
        """No request may shift, for ``reason`` (None: no reason); with shifting on by
        default, that is an error at start (`KVChatError`), in one line."""
        if reason is None:
            return
        self.refusal = reason
        if self.default:  # --context-shift on a model or setup that cannot
            raise KVChatError(reason)

    def wants(self, shift: bool | None) -> bool:
        """Whether a request asking ``shift`` (None: the engine's default) shifts; raises
        `RequestError` where this model or context cannot."""
        on = self.default if shift is None else bool(shift)
        if on and self.refusal is not None:
            raise RequestError(self.refusal)
        bs = self.blocks.block_size
        if on and self.cap < (self.sink_blocks + 2) * bs:
            raise RequestError(f"context shift needs room for {self.sink_blocks} sink "
                               f"block(s) and two more ({bs} tokens each); the context "
                               f"holds {self.cap} tokens")
        return on

    def needs_shift(self, req: Request) -> bool:
        n = self.blocks.num_tokens.get(req.request_id, 0)
        return req.context_shift and n + 1 > self.cap

    def make_room(self, req: Request) -> str | None:
        """Before a decode step of ``req``: drop drafts that would cross the context, and
        shift the sequence if its next token would not fit. Returns an error, or None."""
        n = self.blocks.num_tokens.get(req.request_id, 0)
        if not req.context_shift or n + 1 + len(req.draft) <= self.cap:
            return None
        req.draft = []
        if n + 1 <= self.cap:
            return None
        rid, sink = req.request_id, self.sink_blocks
        drop = context_shift.plan_drop(len(self.blocks.block_tables[rid]), sink)
        try:
            moved = context_shift.shift(self.blocks, rid, sink, drop)
        except OutOfBlocksError as e:
            return f"context shift failed: {e}"
        self.keys.kv.copy_blocks(moved.copies)
        self.keys.shift(moved.moved, moved.delta)
        req.num_sinks = sink * self.blocks.block_size
        req.num_dropped += moved.delta
        req.num_computed -= moved.delta
        req.prefix.frozen = True
        s = req.stats
        s.context_shifts += 1
        s.shifted_tokens += moved.delta
        return None
