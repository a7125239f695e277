"""The block side of a context shift: drop a sequence's blocks after its sinks.

A sequence that fills its context keeps its first ``sink`` blocks (attention sinks,
StreamingLLM) and its newest blocks, and gives the ``drop`` blocks between back. The
kept blocks after the sinks then hold tokens ``drop * block_size`` positions earlier
than they were computed at: their keys must be re-rotated (`model.rope_shift`), which
writes them, so

- a dropped block is only dereferenced (another sequence may share it; a cached one
  stays cached: its K/V is still right for its prefix key);
- a moved block that another sequence shares is copied first (copy-on-write) and the
  copy is rotated; the shared original stays as it was;
- a moved block the prefix cache names loses its name: after the rotation its K/V is no
  longer the K/V of that prefix.

Pure bookkeeping on `BlockManager` (its friend module); the caller copies and rotates.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import OutOfBlocksError
from engine.kvcache.block_manager import BlockManager


@dataclass(slots=True)
class BlockShift:
    """What a shift asks of the pool, in order: copy, then rotate the moved blocks' keys."""

    copies: list[tuple[int, int]]  # (src, dst) copy-on-write of shared moved blocks
    moved: list[int]  # blocks (after the copies) whose keys move back by ``delta``
    delta: int  # positions the moved tokens move back (tokens dropped)
    freed: int  # blocks that went back to the free list or the cache


def plan_drop(num_blocks: int, sink: int) -> int:
    """Blocks to drop from a full table of ``num_blocks``: half of those after the sinks
    (llama.cpp's n_discard), at least one, always leaving the last block."""
    return max(1, (num_blocks - sink) // 2) if num_blocks - sink > 1 else 0


def can_shift(blocks: BlockManager, seq_id: int, sink: int, drop: int) -> bool:
    table = blocks.block_tables[seq_id]
    if blocks.window is not None or drop < 1 or sink + drop >= len(table):
        return False
    # dropped blocks only this sequence holds come free before the copies take blocks
    freed = sum(1 for b in table[sink:sink + drop] if blocks.ref_counts[b] == 1)
    shared = sum(1 for b in table[sink + drop:] if blocks.ref_counts[b] > 1)
    return shared <= blocks.num_free_blocks + freed


def shift(blocks: BlockManager, seq_id: int, sink: int, drop: int) -> BlockShift:
    """Drop blocks ``sink .. sink + drop - 1`` of ``seq_id``; the rest close up behind the
    sinks. Returns the copies and rotation the pool must do before the next write."""
    if not can_shift(blocks, seq_id, sink, drop):
        raise OutOfBlocksError(f"cannot shift sequence {seq_id} (sinks {sink}, drop {drop})")
    table = blocks.block_tables[seq_id]
    freed = 0
    for b in table[sink:sink + drop]:
        blocks.ref_counts[b] -= 1
        if blocks.ref_counts[b] == 0:
            if b in blocks.block_hash:
                blocks.evictable[b] = None
            else:
                blocks.free_block_ids.append(b)
            freed += 1
    copies, moved = [], []
    for b in table[sink + drop:]:
        if blocks.ref_counts[b] > 1:
            dst = blocks._take_block()
            blocks.ref_counts[b] -= 1
            copies.append((b, dst))
            b = dst
        elif b in blocks.block_hash:
            blocks._unhash(b)
        moved.append(b)
    table[sink:] = moved
    delta = drop * blocks.block_size
    blocks.num_tokens[seq_id] -= delta
    return BlockShift(copies, moved, delta, freed)
