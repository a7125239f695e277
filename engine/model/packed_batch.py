"""A mixed step's inputs: prefill chunks and decodes packed into one ragged token row.

One forward per step runs every new token of the step (the prefill chunks of
several requests, then one token per decoding sequence) through the projections
and MLP as a single (1, T) batch, so the weights are read once per step instead
of once per request, and decodes never wait behind a separate prefill forward.
Attention stays per sequence: each segment attends over its own block table.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from engine.model.attention import contiguous_run


@dataclass(slots=True)
class Segment:
    """One sequence's run of new tokens inside a packed batch."""

    start: int  # index of its first token in the packed row
    length: int
    context_len: int  # tokens in the sequence including the new ones
    block_table: mx.array  # (1, blocks) int32, this sequence's blocks only
    block_run: int | None  # its blocks are the contiguous run from here


@dataclass(slots=True)
class PackedBatch:
    """Inputs of one packed forward: prefill segments first, then the decodes."""

    input_ids: mx.array  # (1, T) int32
    positions: mx.array  # (T,) int32: each token's position in its sequence
    slots: mx.array  # (T,) int32: pool slot of each token
    prefills: list[Segment]
    decode_start: int  # packed index of the first decode token (== T if none)
    decode_tables: mx.array | None  # (D, width) int32, padded with each row's first block
    decode_lens: list[int]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])


def pack(prefills: list[tuple[list[int], list[int], list[int], int]],
         decodes: list[tuple[int, int, list[int], int]]) -> PackedBatch:
    """Pack a step: prefills as (token ids, slots, block table, context length after the
    chunk); decodes as (token id, slot, block table, context length after the token)."""
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    segments = []
    for tokens, seq_slots, table, ctx in prefills:
        n = len(tokens)
        segments.append(Segment(len(ids), n, ctx, mx.array([table], dtype=mx.int32),
                                contiguous_run(table)))
        ids += tokens
        slots += seq_slots
        positions += range(ctx - n, ctx)
    decode_start = len(ids)
    tables, lens = [], []
    for token, slot, table, ctx in decodes:
        ids.append(token)
        slots.append(slot)
        positions.append(ctx - 1)
        tables.append(table)
        lens.append(ctx)
    decode_tables = None
    if tables:
        width = max(len(t) for t in tables)
        decode_tables = mx.array([t + [t[0]] * (width - len(t)) for t in tables],
                                 dtype=mx.int32)
    return PackedBatch(
        input_ids=mx.array([ids], dtype=mx.int32),
        positions=mx.array(positions, dtype=mx.int32),
        slots=mx.array(slots, dtype=mx.int32),
        prefills=segments,
        decode_start=decode_start,
        decode_tables=decode_tables,
        decode_lens=lens,
    )
