"""The default model on the CPU extension path: what the loader records, and greedy
generation against mlx-lm running the same Q4/Q8 weights as shipped."""

from __future__ import annotations

import mlx.nn as nn
from test_engine_parity import mlx_lm_greedy

from engine import Engine, EngineConfig, SamplingParams, load_model
from engine.model.cpu_ext.linear import (
    CpuQuantizedEmbedding,
    CpuQuantizedLinear,
    CpuTiledEmbedding,
    CpuTiledLinear,
    tiled_enabled,
)
from engine.model.cpu_ext.norm_rope import CpuRMSNorm, CpuRoPE
from engine.model.fingerprint import model_fingerprint

# Greedy tokens are compared position by position up to the first difference. The
# extension sums in another order than MLX's quantized matmul and keeps K/V in
# float16, so a near-tie between two tokens can flip (and everything after it
# differs). Measured: all 383 tokens of the 9 parity prompts (up to 48 each) agree;
# the floor leaves room for one near-tie late in a run on another CPU. One prompt
# only: mlx-lm on MLX's own quantized matmul is slow here (~7 tok/s).
MIN_AGREEING_PREFIX = 10
PROMPT = "Write a haiku about the sea."


def test_loader_records_the_extension_path(default_model_ext, default_model):
    m = default_model_ext
    assert m.cpu_ext and m.weight_format == "q4/q8"
    assert m.weight_bytes < 110e6  # the shipped Q4/Q8 bytes, not ~540 MB of float32
    # same weights, other rounding: its prefix-cache salt must differ from the float path's
    assert m.fingerprint != model_fingerprint(m.path) == default_model.fingerprint
    assert not default_model.cpu_ext and default_model.weight_format == "float32"
    kinds = [type(x) for _, x in m.model.named_modules()]
    # on AVX-512 VNNI the 4-bit linears are tiled (KVCHAT_TILED=0: not)
    tiled = tiled_enabled()
    linear = CpuTiledLinear if tiled else CpuQuantizedLinear
    embedding = CpuTiledEmbedding if tiled else CpuQuantizedEmbedding
    assert kinds.count(linear) == 7 * 30 and embedding in kinds
    assert m.matmul == ("cpu-ext tiled int16-x" if tiled else "cpu-ext float")
    assert default_model.matmul == "mlx"
    assert kinds.count(CpuRMSNorm) == 2 * 30 + 1 and kinds.count(CpuRoPE) == 30
    assert not any(type(x) is nn.QuantizedLinear for x in kinds)


def agreeing_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_greedy_agrees_with_mlx_lm_as_shipped(default_model_ext):
    engine = Engine(default_model_ext, EngineConfig(kv_budget_bytes=64 << 20))
    assert all(f is not None and f.qkv_proj is not None for f in engine.runner.fused)
    shipped = load_model(weights="shipped")  # MLX's own quantized matmul, as mlx-lm runs it
    ids = engine.encode_prompt(PROMPT)
    ours = engine.generate_text(ids, SamplingParams(max_tokens=16)).tokens
    ref = mlx_lm_greedy(shipped.model, ids, 16, 512, set(shipped.tokenizer.eos_token_ids))
    assert agreeing_prefix(ours, ref) >= min(MIN_AGREEING_PREFIX, len(ref)), (ours, ref)
    answer = engine.generate_text(engine.encode_prompt("What is the capital of France?"),
                                  SamplingParams(max_tokens=30))
    assert answer.text == "The capital of France is Paris."
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
