"""The paged forward at model level: batched decode of ragged sequences == one at a time."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from engine import Engine, EngineConfig
from engine.executor import build_batch
from engine.model.model_runner import StepBatch


def forward(engine: Engine, seq_id: int, ids: list[int], *, logits: bool):
    """Append ``ids`` to one sequence and run the model over them (no scheduler)."""
    plan = engine.blocks.append(seq_id, len(ids))
    engine.kv.copy_blocks(plan.copies)
    batch = build_batch(engine.blocks, [seq_id], mx.array([ids], dtype=mx.int32), [plan.slots])
    return engine.runner(batch, engine.kv, logits=logits)


def prefill(engine: Engine, seq_id: int, ids: list[int]) -> None:
    engine.blocks.allocate(seq_id)
    forward(engine, seq_id, ids, logits=False)
    mx.eval(engine.kv.keys, engine.kv.values)


def test_batched_decode_matches_single_sequences(default_model):
    engine = Engine(default_model, EngineConfig(kv_budget_bytes=64 << 20, block_size=16))
    tok = default_model.tokenizer
    prompts = [tok.encode("The quick brown fox jumps over the lazy dog. " * k) for k in (1, 3, 6)]
    nxt = [5, 17, 99]
    # one at a time
    single = []
    for i, ids in enumerate(prompts):
        prefill(engine, 100 + i, ids)
        single.append(np.array(forward(engine, 100 + i, [nxt[i]], logits=True)[0]))
        engine.blocks.free(100 + i)
    # all three in one forward: ragged lengths, each with its own block table
    for i, ids in enumerate(prompts):
        prefill(engine, i, ids)
    plans = [engine.blocks.append(i, 1) for i in range(3)]
    tables = [engine.blocks.block_tables[i] for i in range(3)]
    width = max(len(t) for t in tables)
    lens = [engine.blocks.num_tokens[i] for i in range(3)]
    batch = StepBatch(
        input_ids=mx.array(nxt, dtype=mx.int32)[:, None],
        offsets=mx.array([n - 1 for n in lens], dtype=mx.int32),
        slots=mx.array([p.slots[0] for p in plans], dtype=mx.int32),
        block_tables=mx.array([t + [0] * (width - len(t)) for t in tables], dtype=mx.int32),
        context_lens=lens,
    )
    logits = np.array(engine.runner(batch, engine.kv))
    assert logits.shape[0] == 3 and len(set(lens)) == 3
    for i in range(3):
        np.testing.assert_allclose(logits[i], single[i], atol=2e-3, rtol=1e-3)
        assert logits[i].argmax() == single[i].argmax()
    for i in range(3):
        engine.blocks.free(i)
    engine.blocks.check_invariants()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_engine_built_on_another_thread_shares_the_model(default_model):
    """Fused weights are materialized: a later engine on another thread can use them."""
    import threading

    from engine import SamplingParams

    first = Engine(default_model, EngineConfig(kv_budget_bytes=16 << 20))
    out = {}

    def other():
        e = Engine(default_model, EngineConfig(kv_budget_bytes=16 << 20))
        out["text"] = e.generate_text(e.encode_prompt("Hi"), SamplingParams(max_tokens=4)).text

    t = threading.Thread(target=other)
    t.start()
    t.join()
    text = first.generate_text(first.encode_prompt("Hi"), SamplingParams(max_tokens=4)).text
    assert out["text"] == text and text
