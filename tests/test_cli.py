"""`kvchat generate` / `estimate` as a user runs them: real process, real model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ENV = dict(os.environ)


def kvchat(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "app", *args], capture_output=True, text=True,
                          timeout=timeout, env=ENV)


def assert_one_line_error(proc, needle: str):
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvchat: error:"), proc.stderr
    assert needle in lines[0]
    assert "Traceback" not in proc.stderr


def test_generate_json_fields():
    proc = kvchat("generate", "--prompt", "What is the capital of France?", "--json",
                  "--max-tokens", "12")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    for key in ("text", "tokens", "prompt_tokens", "generation_tokens", "finish_reason",
                "ttft_s", "prefill_tps", "decode_tps", "kv"):
        assert key in out
    assert out["text"] == "The capital of France is Paris."
    assert out["generation_tokens"] == len(out["tokens"])
    kv = out["kv"]
    assert kv["bytes_per_token"] == 30 * 2 * 3 * 64 * 4  # float32 KV on CPU
    assert kv["blocks_used"] == -(-(out["prompt_tokens"] + out["generation_tokens"]) // 16)
    assert kv["bytes_used"] == kv["blocks_used"] * 16 * kv["bytes_per_token"]


def test_generate_streams_text_and_stats(tmp_path):
    prompt = tmp_path / "p.txt"
    prompt.write_text("Count from one to five.")
    proc = kvchat("generate", "--prompt-file", str(prompt), "--max-tokens", "8", "--raw")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()
    assert "tok/s decode" in proc.stderr


@pytest.mark.parametrize("args,needle", [
    (["generate", "--prompt", "   "], "prompt is empty"),
    (["generate", "--prompt", "hi", "--model", "/no/such/model"], "model not found"),
    (["generate", "--prompt", "hi", "--model", "nobody/not-a-cached-repo"], "local Hugging Face"),
    (["generate", "--prompt-file", "/no/such/file.txt"], "cannot read prompt file"),
])
def test_bad_input_is_one_clear_line(args, needle):
    assert_one_line_error(kvchat(*args), needle)


def test_corrupt_model_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "model.safetensors").write_bytes(b"\x00garbage" * 100)
    assert_one_line_error(kvchat("generate", "--prompt", "hi", "--model", str(tmp_path)),
                          "cannot load model")


@pytest.mark.parametrize("header", [b"GGUF" + os.urandom(20),  # caught by the header check
                                    b"GGUF" + (3).to_bytes(4, "little") + bytes(16)])  # reader
def test_corrupt_gguf(tmp_path, header):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(header + os.urandom(200))
    assert_one_line_error(kvchat("generate", "--prompt", "hi", "--model", str(bad)), "GGUF")
    models = Path(ENV["KVCHAT_HOME"]) / "models"
    assert not any("broken" in p.name for p in models.glob("*"))  # nothing half-written


def test_prompt_longer_than_context(tmp_path):
    prompt = tmp_path / "long.txt"
    prompt.write_text("lorem ipsum dolor sit amet " * 2000)  # > 8192 tokens
    assert_one_line_error(kvchat("generate", "--prompt-file", str(prompt)), "context holds 8192")


def test_estimate_matches_formula():
    proc = kvchat("estimate", "--tokens", "8192", "--batch", "2", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["bytes_per_token"] == 30 * 2 * 3 * 64 * 2 == 23_040
    assert out["total_bytes"] == 23_040 * 8192 * 2
    assert out["blocks"] == 2 * 8192 // 16
    assert out["engine_memory_limit_bytes"] > 0
    assert out["kv_budget_blocks"] == (1 << 30) // (16 * 23_040)
    assert out["fits_kv_budget"] is True  # 360 MiB of blocks in a 1 GiB pool
    q8 = json.loads(kvchat("estimate", "--tokens", "100", "--kv-bits", "8", "--json").stdout)
    assert q8["bytes_per_token"] == pytest.approx(30 * 2 * 3 * 64 * (1 + 4 / 64))


def test_hub_repo_id_from_local_cache(tmp_path, default_model):
    """A repo id resolves through the Hugging Face cache layout, offline."""
    import shutil

    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    config = dict(model_type="qwen3", hidden_size=32, num_hidden_layers=1, intermediate_size=64,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-6,
                  rope_theta=1e6, max_position_embeddings=512, tie_word_embeddings=True,
                  vocab_size=default_model.config["vocab_size"], eos_token_id=2)
    model_cls, args_cls = _get_classes(config)
    model = model_cls(args_cls.from_dict(config))
    repo = tmp_path / "hub" / "models--kvchat-test--tiny-qwen3"
    commit = "0123456789abcdef0123456789abcdef01234567"
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    mx.save_safetensors(str(snap / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (snap / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model.path / name, snap / name)
    env = dict(ENV, HF_HUB_CACHE=str(tmp_path / "hub"), HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-m", "app", "generate", "--model",
                           "kvchat-test/tiny-qwen3", "--prompt", "hello", "--raw", "--json",
                           "--max-tokens", "3"], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["model"]["path"] == str(snap)
    assert out["kv"]["bytes_per_token"] == 1 * 2 * 1 * 16 * 4
