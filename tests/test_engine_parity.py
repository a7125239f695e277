"""Greedy tokens of the paged engine == mlx-lm with its dense KV cache, same weights.

The reference is mlx-lm's own `generate_step` over the very model object the
engine runs (same weights, same format), with mlx-lm's prefill step size set to
the engine's prefill chunk so both see the same chunk boundaries.
"""

from __future__ import annotations

import inspect
import textwrap

import mlx.core as mx
import pytest

from engine import Engine, EngineConfig, SamplingParams, load_model

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a KV cache is in one paragraph.",
    "List three prime numbers greater than 100.",
    "Translate 'good morning, my friend' into Spanish and French.",
    "Write a Python function that reverses a string.",
    "Why is the sky blue? Answer briefly.",
    "Give me a recipe for pancakes.",
    "What is 17 times 23? Show your work.",
]
# What each float32 parity prompt adds (measured on the embedded model): "capital of France"
# ends on EOS after 8 tokens and runs first, on a cold pool (no cached prefix); "KV cache"
# runs to max_tokens (48) through three more blocks, on the system prompt's cached blocks;
# the long document prefills in five 512-token chunks. The other chat prompts only repeated
# one of the first two (the haiku ends on EOS, the rest run to 48) with other words.
PARITY_PROMPTS = [PROMPTS[0], PROMPTS[2]]


def long_document_prompt(tokenizer, min_tokens: int = 2100) -> str:
    """A real long document from the standard library (no network, not in this repo)."""
    source = inspect.getsource(textwrap)
    for n in range(4000, len(source), 1000):
        prompt = "Summarize what this code does:\n\n" + source[:n]
        if len(tokenizer.encode(prompt)) >= min_tokens:
            return prompt
    raise AssertionError("document too short")


def mlx_lm_greedy(model, ids: list[int], max_tokens: int, prefill_step: int, eos: set[int]):
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    out = []
    for token, _ in generate_step(mx.array(ids), model, max_tokens=max_tokens,
                                  sampler=make_sampler(0.0), prefill_step_size=prefill_step):
        out.append(int(token))
        if out[-1] in eos:
            break
    return out


def engine_greedy(engine: Engine, ids: list[int], max_tokens: int):
    r = engine.generate_text(ids, SamplingParams(max_tokens=max_tokens))
    return r.tokens, r.stats


@pytest.mark.slow
def test_default_model_matches_mlx_lm(default_model):
    engine = Engine(default_model, EngineConfig(kv_budget_bytes=256 << 20, prefill_chunk=512))
    tok = default_model.tokenizer
    prompts = [engine.encode_prompt(p) for p in PARITY_PROMPTS]
    prompts.append(engine.encode_prompt(long_document_prompt(tok)))
    assert len(prompts[-1]) > 2000
    eos = set(tok.eos_token_ids)
    endings = []
    for ids in prompts:
        n = 48 if len(ids) < 1000 else 16
        ours, stats = engine_greedy(engine, ids, n)
        ref = mlx_lm_greedy(default_model.model, ids, n, 512, eos)
        assert ours == ref, tok.decode(ids)[-200:]
        assert stats.blocks_released == stats.blocks_used
        endings.append((ours[-1] in eos, stats.cached_tokens > 0))
    # each ending and cache state the prompts were chosen for still happens
    assert endings == [(True, False), (False, True), (False, True)]
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_default_model_answers_paris(default_engine):
    ids = default_engine.encode_prompt("What is the capital of France?")
    r = default_engine.generate_text(ids, SamplingParams(max_tokens=30))
    assert r.text == "The capital of France is Paris."
    assert r.finish_reason == "stop"


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("block_size,chunk", [(4, 7), (16, 64)])
def test_tiny_models_match_mlx_lm(tiny_model_dir, kind, block_size, chunk):
    loaded = load_model(str(tiny_model_dir(kind)))
    assert loaded.model_type == kind
    engine = Engine(loaded, EngineConfig(block_size=block_size, kv_budget_bytes=8 << 20,
                                         prefill_chunk=chunk))
    texts = PROMPTS[:3] + ["word " * 90]
    for text in texts:
        ids = engine.encode_prompt(text, raw=True)
        ours, _ = engine_greedy(engine, ids, 20)
        ref = mlx_lm_greedy(loaded.model, ids, 20, chunk, set())
        assert ours == ref[: len(ours)] and len(ours) == 20
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


@pytest.mark.slow
def test_shipped_quantized_weights_match_mlx_lm():
    """`--weights shipped`: the GGUF's own Q4/Q8 weights, as mlx-lm runs them (fp16 KV)."""
    loaded = load_model(weights="shipped")
    assert loaded.weight_format == "q4/q8"
    engine = Engine(loaded, EngineConfig(kv_budget_bytes=64 << 20))
    assert engine.layout.bytes_per_token == 23_040  # DESIGN.md's fp16 figure
    eos = set(loaded.tokenizer.eos_token_ids)
    for text in PARITY_PROMPTS:  # an EOS ending and a max_tokens one
        ids = engine.encode_prompt(text)
        ours, _ = engine_greedy(engine, ids, 12)
        assert ours == mlx_lm_greedy(loaded.model, ids, 12, 512, eos)
