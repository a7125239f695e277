"""The inputs of a forward over sequences whose new tokens already have pool slots."""

from __future__ import annotations

import mlx.core as mx

from engine.kvcache.block_manager import BlockManager
from engine.model.attention import contiguous_run
from engine.model.model_runner import StepBatch


def build_batch(blocks: BlockManager, seq_ids: list[int], input_ids: mx.array,
                slots: list[list[int]], unreserved: int = 0) -> StepBatch:
    """The forward's inputs for sequences whose new tokens already have ``slots``
    (``unreserved``: that many of them are not counted in the block manager yet)."""
    tables = [blocks.block_tables[i] for i in seq_ids]
    lens = [blocks.num_tokens[i] + unreserved for i in seq_ids]
    L = input_ids.shape[1]
    width = max(len(t) for t in tables)
    return StepBatch(
        input_ids=input_ids,
        offsets=mx.array([n - L for n in lens], dtype=mx.int32),
        slots=mx.array([s for ss in slots for s in ss], dtype=mx.int32),
        block_tables=mx.array([t + [t[0]] * (width - len(t)) for t in tables], dtype=mx.int32),
        context_lens=lens,
        block_run=contiguous_run(tables[0]) if len(seq_ids) == 1 else None,
    )
