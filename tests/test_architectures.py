"""The parity matrix: every architecture `architectures.ARCHITECTURES` lists, as a tiny
random-weight model built from mlx-lm's own classes (tests/arch_zoo.py), float and 4-/8-bit.

Each run checks paged greedy tokens against mlx-lm's own generation with its own caches
(rotating ones for windowed layers): 64 tokens from prompts longer than every window.
Then, on the engine alone: batched == alone, prefix cache cold == warm RAM == warm disk,
and preemption by recompute and by swap resumes exactly.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from arch_zoo import VOCAB, WINDOW, ZOO, build
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_engine_parity import mlx_lm_greedy

from engine import Engine, EngineConfig, SamplingParams, load_model
from engine.errors import KVChatError, ModelLoadError, RequestError
from engine.model import architectures

NEW_TOKENS = 64
PROMPT = 40  # > WINDOW: sliding layers lose their first positions during the prompt
EOS = 2
# one per architecture family that the README table lists; llama appears twice (Llama 3.x
# rope_scaling; sliding layer_types)
FLOAT = sorted(ZOO)
# every architecture with 8-bit and with 4-bit weights (mlx-lm's quantize_model)
QUANT = [(name, bits) for name in FLOAT for bits in (8, 4)]
PATHS = ["gemma3_text", "gpt_oss", "qwen3_moe", "cohere2", "llama_sliding"]


@pytest.fixture(scope="session")
def zoo(tmp_path_factory, default_model):
    """Factory: the loaded tiny model ``(name, bits)``, built once per session."""
    made = {}

    def get(name: str, bits: int | None = None):
        if (name, bits) not in made:
            path = tmp_path_factory.mktemp("zoo") / f"{name}-{bits or 'f32'}"
            build(path, name, default_model.path, eos=EOS, bits=bits, seed=len(name))
            made[name, bits] = load_model(str(path), weights="shipped" if bits else "float32")
        return made[name, bits]

    return get


def prompts(n: int = 3, length: int = PROMPT) -> list[list[int]]:
    rng = np.random.default_rng(length)
    return [[int(t) for t in rng.integers(3, VOCAB, length + 3 * i)] for i in range(n)]


def config(**kw) -> EngineConfig:
    """Small enough that windowed layers get their own store (`wiring.window_pool`)."""
    return EngineConfig(**{"kv_budget_bytes": 16 << 20, "max_running": 4, **kw})


def windows_stored_apart(engine: Engine) -> bool:
    return engine.kv.window is not None and any(engine.kv.windowed)


def greedy(engine: Engine, ids: list[int], n: int = NEW_TOKENS, **kw):
    r = engine.generate_text(ids, SamplingParams(max_tokens=n, ignore_eos=True), **kw)
    return r.tokens, r.stats


def test_windows_come_from_the_models_own_caches(zoo):
    runner = Engine(zoo("gemma3_text"), EngineConfig(kv_budget_bytes=8 << 20)).runner
    assert runner.windows == [WINDOW, None, WINDOW, None]  # sliding_window_pattern=2
    assert [s.window for s in runner.attention] == runner.windows
    assert "2 sliding (window 16) + 2 global" in runner.describe()


@pytest.mark.parametrize("name", FLOAT)
def test_float_matches_mlx_lm(zoo, name):
    loaded = zoo(name)
    engine = Engine(loaded, config(prefill_chunk=16))
    assert windows_stored_apart(engine) == any(engine.runner.windows)
    ids = prompts(1)[0]
    ours, stats = greedy(engine, ids)
    ref = mlx_lm_greedy(loaded.model, ids, NEW_TOKENS, 16, set())
    assert ours == ref
    assert len(set(ref)) > 8, "a degenerate model would compare nothing"
    assert stats.blocks_released == stats.blocks_used
    engine.blocks.check_invariants()


@pytest.mark.parametrize("name,bits", QUANT)
def test_quantized_matches_mlx_lm(zoo, name, bits):
    loaded = zoo(name, bits)
    assert loaded.weight_format.startswith("q")
    # one 64-token prefill chunk: the window is cut inside a chunk as well as across chunks
    engine = Engine(loaded, config(prefill_chunk=64))
    assert windows_stored_apart(engine) == any(engine.runner.windows)
    ids = prompts(1)[0]
    ours, _ = greedy(engine, ids)
    assert ours == mlx_lm_greedy(loaded.model, ids, NEW_TOKENS, 64, set())


def test_a_window_the_engine_ignored_would_be_caught(zoo):
    """The check can fail: the same model with its windows dropped disagrees with mlx-lm."""
    loaded = zoo("gemma3_text")
    engine = Engine(loaded, config(prefill_chunk=16, window_pool=False))
    ids = prompts(1)[0]
    ref = mlx_lm_greedy(loaded.model, ids, NEW_TOKENS, 16, set())
    runner = engine.runner
    runner.windows = [None] * len(runner.windows)
    runner.attention = [type(s)(s.scale) for s in runner.attention]
    assert greedy(engine, ids)[0] != ref


@pytest.mark.parametrize("name", PATHS)
def test_batched_equals_alone(zoo, name):
    loaded = zoo(name)
    # alone on a pool that keeps every block in every layer; together on the window store
    alone = Engine(loaded, config(prefix_cache=False, prefill_chunk=16, window_pool=False))
    want = [greedy(alone, ids, 24)[0] for ids in prompts()]
    together = Engine(loaded, config(prefix_cache=False, prefill_chunk=16))
    assert windows_stored_apart(together) == any(together.runner.windows)
    p = SamplingParams(max_tokens=24, ignore_eos=True)
    handles = [together.submit(ids, p) for ids in prompts()]
    got = [[e.token for e in h if e.token is not None] for h in handles]
    assert got == want
    m = together.metrics()
    steps = [m.decode_forward, m.mixed_forward]
    assert sum(c.tokens for c in steps) > sum(c.steps for c in steps), "never batched"
    together.blocks.check_invariants()
    assert m.blocks_free == m.blocks_total


def warm_runs(loaded, ids: list[int], tmp_path, check=None, **kw) -> tuple[list, list, list]:
    """Greedy tokens of ``ids`` twice on an engine with a disk prefix store (cold, then
    from memory), then on a fresh engine over the same store (from disk); ``check`` sees
    the first engine before it shuts down. Asserts where each run's prefix came from."""

    def disk_engine():
        return Engine(loaded, config(disk_cache=True, disk_cache_dir=str(tmp_path / "prefix"),
                                     **kw))

    engine = disk_engine()
    (first, s1), (ram, s2) = greedy(engine, ids, 24), greedy(engine, ids, 24)
    engine.blocks.check_invariants()
    if check is not None:
        check(engine)
    engine.shutdown()
    disk, s3 = greedy(disk_engine(), ids, 24)
    assert (s1.cache_source, s2.cache_source, s3.cache_source) == ("none", "memory", "disk")
    assert s2.cached_tokens == s3.cached_tokens == 64
    return first, ram, disk


@pytest.mark.parametrize("name", PATHS)
def test_prefix_cache_cold_warm_ram_warm_disk(zoo, name, tmp_path):
    loaded = zoo(name)
    ids = prompts(1, 70)[0]  # four whole blocks cached, each past the window
    cold, s0 = greedy(Engine(loaded, config(prefix_cache=False, window_pool=False)), ids, 24)
    assert s0.cached_tokens == 0

    def stored_apart(engine):
        assert windows_stored_apart(engine) == any(engine.runner.windows)

    first, ram, disk = warm_runs(loaded, ids, tmp_path, stored_apart, prefill_chunk=16)
    assert first == ram == disk == cold


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("name", ["gemma3_text", "gpt_oss"])
def test_preemption_resumes_exactly(zoo, name, mode):
    loaded = zoo(name)
    fixed = dict(block_size=4, max_running=3, step_target_s=None, prefix_cache=False,
                 prefill_chunk=16)
    alone = Engine(loaded, config(window_pool=False, **fixed))
    long = prompts(3, 120)
    want = [greedy(alone, ids, 48)[0] for ids in long]
    roomy = Engine(loaded, config(**fixed))
    # the prompts fit in 100 pool blocks (93), their answers do not (129): preemption;
    # the windowed layers' store (41 blocks) is smaller, as at real context lengths
    budget = roomy.kv.bytes_for(100, roomy.kv.window.num_window_blocks)
    tight = Engine(loaded, config(kv_budget_bytes=budget, preempt_mode=mode, **fixed))
    assert tight.blocks.num_blocks == 100 and windows_stored_apart(tight)
    assert tight.kv.window.num_window_blocks < tight.blocks.num_blocks
    p = SamplingParams(max_tokens=48, ignore_eos=True)
    handles = [tight.submit(ids, p) for ids in long]
    got = [[e.token for e in h if e.token is not None] for h in handles]
    m = tight.metrics()
    assert m.preemptions > 0, "no pressure"
    assert got == want
    tight.blocks.check_invariants()
    assert m.blocks_free == m.blocks_total


KIVI = dict(kv_bits=4, kv_residual=True, kv_key_channel=True)  # the q4-kivi format


@pytest.fixture(scope="module")
def sliding64(tmp_path_factory, default_model):
    """llama_sliding at head dim 64: kvchat's own layers on the extension's residual op."""
    path = tmp_path_factory.mktemp("zoo") / "llama_sliding64"
    build(path, "llama_sliding", default_model.path, eos=EOS, seed=7, bits=8,
          overrides={"head_dim": 64})
    return load_model(str(path), weights="shipped")


@pytest.mark.parametrize("name", ["gpt_oss", "llama_sliding64"])
def test_a_residual_pool_runs_windowed_layers(zoo, sliding64, name, tmp_path):
    """q4-kivi on windowed models (gpt-oss: mlx-lm's modules, windows and sinks; a Llama
    with sliding layers: kvchat's own), both on the extension's residual op: no window
    store, every layer keeps every block and reads its window. Alone == batched, cold ==
    warm from RAM and from disk, every block and residual row given back. Prompts are
    prefilled whole: a prompt's last tokens fed as decode rows round otherwise on a
    quantized pool (the decode op meets quantized keys with int16 queries). 8-bit weights:
    the extension's matmuls compute a row alike in any batch, where OpenBLAS's float32 GEMM
    rounds a row by the batch's row count (~1e-5), enough to flip a random model's near-tie."""
    loaded = sliding64 if name == "llama_sliding64" else zoo(name, 8)
    alone = Engine(loaded, config(prefix_cache=False, step_target_s=None, **KIVI))
    assert alone.layout.residual and alone.kv.window is None and any(alone.runner.windows)
    want = [greedy(alone, ids, 24)[0] for ids in prompts()]
    together = Engine(loaded, config(prefix_cache=False, step_target_s=None, **KIVI))
    p = SamplingParams(max_tokens=24, ignore_eos=True)
    handles = [together.submit(ids, p) for ids in prompts()]
    assert [[e.token for e in h if e.token is not None] for h in handles] == want
    ids = prompts(1, 70)[0]  # four whole blocks cached, each past the window
    cold = greedy(alone, ids, 24)[0]

    def nothing_held(engine):
        engine.kv.reclaim()
        assert engine.kv.num_residual_blocks == 0
        assert engine.metrics().blocks_free == engine.metrics().blocks_total

    first, ram, disk = warm_runs(loaded, ids, tmp_path, nothing_held, step_target_s=None,
                                 **KIVI)
    assert first == ram == disk == cold


def test_a_residual_pool_refuses_windows_off_the_extension_op(zoo):
    with pytest.raises(KVChatError, match="head dim 64 or 128 only .this model's is 256"):
        Engine(zoo("gemma3_text"), config(**KIVI))


@pytest.mark.parametrize("model_type,why", [
    ("qwen3_next", "recurrent state"), ("nemotron_h", "recurrent state"),
    ("lfm2", "recurrent state"), ("deepseek_v3", "latent attention"),
    ("kimi_k25", "latent attention"), ("gemma4_text", "shares K/V across layers"),
    ("bert_of_the_future", "not supported yet"),
])
def test_unservable_architectures_are_refused_in_one_line(tmp_path, model_type, why):
    (tmp_path / "config.json").write_text(f'{{"model_type": "{model_type}"}}')
    with pytest.raises(ModelLoadError) as e:
        load_model(str(tmp_path))
    assert why in str(e.value) and "\n" not in str(e.value)


def test_a_wrapped_text_model_is_checked_by_its_inner_type():
    assert architectures.check_supported(
        {"model_type": "mistral3", "text_config": {"model_type": "ministral3"}}
    ).model_type == "ministral3"
    with pytest.raises(ValueError, match="latent attention"):
        architectures.check_supported({"model_type": "mistral3",
                                       "text_config": {"model_type": "mistral4"}})


def test_generate_says_what_a_brought_model_runs_as(tmp_path, default_model, kvchat_cli):
    vocab = default_model.config["vocab_size"]  # the CLI encodes text with the tokenizer
    path = build(tmp_path / "gemma", "gemma3_text", default_model.path, eos=EOS,
                 overrides={"vocab_size": vocab})
    code, out, err = kvchat_cli("generate", "--model", str(path), "--prompt", "Hello there",
                                "--max-tokens", "4", "--weights", "float32")
    assert code == 0, err
    assert "kvchat: model" in err and "2 sliding (window 16) + 2 global" in err
    code, out, err = kvchat_cli("generate", "--model", str(path), "--prompt", "Hello there",
                                "--max-tokens", "4", "--weights", "float32", "--json")
    assert code == 0, err
    assert "sliding (window 16)" in json.loads(out)["model"]["architecture"]


def test_generate_refuses_a_state_space_model_in_one_line(tmp_path, kvchat_cli):
    (tmp_path / "config.json").write_text('{"model_type": "qwen3_next"}')
    code, out, err = kvchat_cli("generate", "--model", str(tmp_path), "--prompt", "Hi")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("kvchat: error:"), err
    assert "recurrent state" in lines[0] and "Traceback" not in err


def test_config_summary_for_the_models_screen():
    gemma = dict(ZOO["gemma3_text"])
    assert architectures.summary(gemma) == "gemma3_text, 4 layers, sliding window 16"
    oss = architectures.summary(dict(ZOO["gpt_oss"]))
    assert "attention sinks" in oss and "4 experts" in oss
    assert "not supported (keeps recurrent state" in architectures.summary({"model_type": "jamba"})
    assert architectures.summary({"model_type": "bert9"}) == "bert9: not supported yet"


def test_gemma3_at_8k_holds_windowed_layers_for_their_window_only(tmp_path, default_model):
    """Gemma-3 shape (5 sliding layers of window 512 per global one, 1 KV head of 256):
    KV bytes ~ global layers x context + windowed layers x (window + margin)."""
    path = build(tmp_path / "gemma8k", "gemma3_text", default_model.path, eos=EOS,
                 overrides=dict(num_hidden_layers=6, sliding_window=512,
                                sliding_window_pattern=6, max_position_embeddings=32768))
    loaded = load_model(str(path), weights="float32")
    ids = prompts(1, 8300)[0]
    engine = Engine(loaded, config(kv_budget_bytes=64 << 20, max_running=1,
                                   prefix_cache=False))
    kv = engine.kv
    assert kv.windowed == [True] * 5 + [False] and kv.window.window == 512
    ours, stats = greedy(engine, ids, 8)
    assert ours == mlx_lm_greedy(loaded.model, ids, 8, 512, set())
    per_token_layer = engine.layout.bytes_per_token // 6  # K + V of one layer, one token
    context = stats.blocks_used * 16
    held = stats.bytes_used - context * per_token_layer  # the five windowed layers' part
    assert held % (5 * per_token_layer) == 0
    assert 512 <= held // (5 * per_token_layer) <= 512 + 2 * 512 + 2 * 16
    # the same 64 MiB budget holding every layer's blocks is too small for this context
    plain = Engine(loaded, config(kv_budget_bytes=64 << 20, max_running=1, prefix_cache=False,
                                  window_pool=False))
    with pytest.raises(RequestError, match="KV pool holds"):
        plain.submit(ids, SamplingParams(max_tokens=8))
    plain = Engine(loaded, config(kv_budget_bytes=128 << 20, max_running=1,
                                  prefix_cache=False, window_pool=False))
    assert plain.kv.window is None
    _, full = greedy(plain, ids, 8)
    assert full.bytes_used == 6 * context * per_token_layer
    assert stats.bytes_used < full.bytes_used / 2.5


@settings(max_examples=8, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(name=st.sampled_from(["gemma3_text", "gpt_oss", "olmo3", "qwen3_moe"]),
       kv_heads=st.sampled_from([1, 2]), group=st.sampled_from([1, 3]),
       head_dim=st.sampled_from([32, 64, 128]), window=st.integers(3, 24),
       block_size=st.sampled_from([4, 16]), chunk=st.sampled_from([7, 32]))
def test_drawn_head_layouts_match_mlx_lm(tmp_path_factory, default_model, name, kv_heads,
                                         group, head_dim, window, block_size, chunk):
    """Other head layouts, windows, block sizes and prefill chunks than the fixed matrix."""
    heads = kv_heads * group  # (transformers' config check wants hidden % heads == 0)
    overrides = dict(num_attention_heads=heads, num_key_value_heads=kv_heads,
                     head_dim=head_dim, hidden_size=64 * heads)
    if "sliding_window" in ZOO[name]:
        overrides["sliding_window"] = window
    path = build(tmp_path_factory.mktemp("drawn") / name, name, default_model.path, eos=EOS,
                 seed=window, overrides=overrides)
    loaded = load_model(str(path), weights="float32")
    engine = Engine(loaded, config(prefill_chunk=chunk, block_size=block_size))
    ids = prompts(1, 30 + window)[0]
    ours, _ = greedy(engine, ids, 24)
    assert ours == mlx_lm_greedy(loaded.model, ids, 24, chunk, set())
