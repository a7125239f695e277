"""A decode row's logits depend on its own sequence alone, bit for bit: verify rows (folded
into one attention problem) equal the plain decode steps they stand for, and a sequence
decoded in a batch equals it decoded alone, at contexts long enough for split-K attention
(`csrc/paged_decode_task.h`, `partition_span`). Greedy speculation's token identity rests on
it; int8 activations (`--activations int8`) turned last-bit differences into other tokens."""

from __future__ import annotations

import random

import mlx.core as mx
import pytest

from engine import Engine, EngineConfig, verify
from engine.model.cpu_ext import ops
from engine.model.packed_batch import pack


@pytest.fixture(scope="module")
def engine(default_model_ext):
    return Engine(default_model_ext, EngineConfig(kv_budget_bytes=128 << 20, prefix_cache=False))


def prefilled(engine: Engine, seq: int, ids: list[int], ctx: int) -> list[int]:
    """Sequence ``seq``'s first ``ctx`` tokens of ``ids`` computed into the pool; its table."""
    blocks, kv = engine.blocks, engine.kv
    blocks.allocate(seq, len(ids))
    table = blocks.block_tables[seq]
    for c in range(0, ctx, 512):
        n = min(512, ctx - c)
        batch = pack([(ids[c:c + n], blocks.slots(seq, c, c + n), table, c + n)], [])
        mx.eval(engine.runner.forward_packed(batch, kv), *kv.arrays)
    return table


def decode(engine: Engine, rows) -> mx.array:
    logits = engine.runner.forward_packed(pack([], rows), engine.kv)
    mx.eval(logits, *engine.kv.arrays)
    return logits


@pytest.mark.parametrize("activations", ["int16", "int8"])
def test_verify_rows_and_batches_equal_plain_decode_bit_for_bit(engine, activations):
    ops.request_activations(activations)
    try:
        ctx, R = 1100, 5
        rng = random.Random(7)
        ids = [rng.randrange(1000, 20000) for _ in range(ctx + R)]
        blocks = engine.blocks
        tables = [prefilled(engine, s, ids, ctx) for s in (11, 12, 13)]
        # plain: one decode step at a time on sequence 11
        plain = [decode(engine, verify.rows(ids[ctx + i], [], blocks.slots(11, ctx + i,
                                                                            ctx + i + 1),
                                            tables[0], ctx + i + 1))[0] for i in range(R)]
        # the same tokens as one verify step of sequence 12: a token and R - 1 drafts
        rows = verify.rows(ids[ctx], ids[ctx + 1:ctx + R], blocks.slots(12, ctx, ctx + R),
                           tables[1], ctx + R)
        folded = decode(engine, rows)
        for i in range(R):
            assert mx.array_equal(folded[i], plain[i]), (activations, i)
        # sequence 13's first decode batched with a short sequence's (14: one partition)
        short = prefilled(engine, 14, ids[:41], 40)
        batch = decode(engine, verify.rows(ids[ctx], [], blocks.slots(13, ctx, ctx + 1),
                                           tables[2], ctx + 1)
                       + verify.rows(ids[40], [], blocks.slots(14, 40, 41), short, 41))
        assert mx.array_equal(batch[0], plain[0]), activations
    finally:
        ops.request_activations("int16")
        for s in (11, 12, 13, 14):
            engine.blocks.free(s)
