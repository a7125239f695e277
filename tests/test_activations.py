"""`--activations int8` (the tiled matmul's llama.cpp-style int8 activations) on the real
default model: the engine's invariants hold within the mode (a cached prefix == a cold run,
batched == alone, token for token), the flag sets the process's mode before a load, and the
model's fingerprint (the prefix-cache key) and status say which mode computed its K/V."""

from __future__ import annotations

import argparse
import os

import pytest

from engine import Engine, EngineConfig, SamplingParams, load_model
from engine.model.cpu_ext import build, ops

PROMPTS = ["What is the capital of France?", "Explain what a KV cache is.",
           "Give me a recipe for pancakes."]


@pytest.fixture
def int8(default_model_ext):
    if not ops.tiled_supported():
        pytest.skip("this CPU has no AVX-512 VNNI: the tiled matmul is not built")
    ops.set_activation_bits(8)
    yield default_model_ext
    ops.set_activation_bits(16)


def run(engine: Engine, ids: list[list[int]], n: int = 24) -> list[list[int]]:
    handles = [engine.submit(i, SamplingParams(max_tokens=n, ignore_eos=True)) for i in ids]
    return [[e.token for e in h if e.token is not None] for h in handles]


def test_int8_activations_keep_the_engines_invariants(int8):
    engine = Engine(int8, EngineConfig(kv_budget_bytes=64 << 20, max_running=4,
                                       disk_cache=False))
    doc = " ".join(["The block pool keeps every sequence's keys and values."] * 12)
    ids = [engine.encode_prompt(f"{doc}\n\n{p}") for p in PROMPTS]  # a shared long prefix
    alone = [run(engine, [i])[0] for i in ids]  # the 2nd and 3rd hit the 1st's prefix
    assert engine.metrics().hit_rate > 0.3
    cold = Engine(int8, EngineConfig(kv_budget_bytes=64 << 20, prefix_cache=False,
                                     disk_cache=False))
    assert [run(cold, [i])[0] for i in ids] == alone  # cached prefix == cold
    assert run(cold, ids) == alone  # batched == alone
    assert engine.metrics().blocks_used == 0 and cold.metrics().blocks_used == 0
    ops.set_activation_bits(16)  # the mode is read as products run: here it changes tokens
    sixteen = [run(cold, [i])[0] for i in ids]
    assert sixteen != alone  # int8 rounding shows within 24 tokens of one of three


def test_the_flag_sets_the_mode_and_the_fingerprint_follows(default_model_ext, monkeypatch):
    if not build.available() or not ops.tiled_supported():
        pytest.skip("needs the extension's tiled matmul")
    from app.engine_args import add_engine_args

    # set, not deleted: monkeypatch then restores the environment the flag writes to, and
    # no process the later tests start inherits int8
    monkeypatch.setenv(ops.ACTIVATIONS_ENV, "int16")
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    try:
        args = parser.parse_args(["--activations", "int8"])
        assert args.activations == "int8" and ops.activation_bits() == 8
        assert os.environ[ops.ACTIVATIONS_ENV] == "int8"  # for the processes it starts
        loaded = load_model()
        assert loaded.matmul == "cpu-ext tiled int8-x"
        assert default_model_ext.matmul == "cpu-ext tiled int16-x"
        assert loaded.fingerprint != default_model_ext.fingerprint  # K/V never mix
    finally:
        ops.set_activation_bits(16)
    assert parser.parse_args([]).activations is None and ops.activation_bits() == 16
    assert os.environ[ops.ACTIVATIONS_ENV] == "int8"  # until monkeypatch restores it
    with pytest.raises(ValueError, match="int8 or int16"):
        ops.request_activations("int4")


def test_the_chat_status_says_int8_activations():
    from types import SimpleNamespace

    from app.tui.model_host import ModelHost

    def status(matmul: str) -> str:
        engine = SimpleNamespace(loaded=SimpleNamespace(weight_format="q4/q8", matmul=matmul),
                                 metrics=lambda: SimpleNamespace(kv_format=""))
        return ModelHost.describe_model(SimpleNamespace(engine=engine, model_name=None))

    assert status("cpu-ext tiled int8-x").endswith("weights q4/q8 (int8 activations)")
    assert status("cpu-ext tiled int16-x").endswith("weights q4/q8")
