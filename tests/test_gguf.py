"""GGUF conversion of the embedded default model: names, config, tokenizer, template;
corrupt files and private output."""

from __future__ import annotations

import json
import os
import random
import stat
import struct

import pytest

from engine.errors import ModelLoadError
from engine.model.fingerprint import file_digest
from engine.model.gguf import CONVERTER_VERSION, converted_dir, rename_tensor
from engine.model.loader import default_gguf_path, resolve_model_path
from engine.paths import is_private_tree


def test_tensor_names():
    assert rename_tensor("token_embd.weight") == "model.embed_tokens.weight"
    assert rename_tensor("blk.7.attn_output.weight") == "model.layers.7.self_attn.o_proj.weight"
    assert rename_tensor("blk.2.attn_q.bias", "qwen2") == "model.layers.2.self_attn.q_proj.bias"
    assert rename_tensor("blk.1.attn_k_norm.weight", "qwen3") == (
        "model.layers.1.self_attn.k_norm.weight")
    assert rename_tensor("blk.0.ffn_norm.weight", "gemma3") == (
        "model.layers.0.pre_feedforward_layernorm.weight")
    assert rename_tensor("blk.0.post_ffw_norm.weight", "gemma3") == (
        "model.layers.0.post_feedforward_layernorm.weight")
    assert rename_tensor("blk.3.attn_qkv.weight", "phi3") == (
        "model.layers.3.self_attn.qkv_proj.weight")
    assert rename_tensor("blk.3.ffn_up.weight", "phi3") == "model.layers.3.mlp.gate_up_proj.weight"
    norm = "model.layers.0.post_attention_layernorm.weight"
    assert rename_tensor("blk.0.ffn_norm.weight") == norm
    assert rename_tensor("output_norm.weight") == "model.norm.weight"
    with pytest.raises(ModelLoadError):
        rename_tensor("blk.0.mystery.weight")


def test_converted_config():
    path = resolve_model_path(None)
    config = json.loads((path / "config.json").read_text())
    assert config["rope_traditional"] is True  # GGUF's interleaved Q/K layout
    assert (config["num_hidden_layers"], config["hidden_size"]) == (30, 576)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert config["rope_theta"] == 100000.0 and config["max_position_embeddings"] == 8192
    assert config["tie_word_embeddings"] is True and config["eos_token_id"] == 2
    q = config["quantization"]
    assert q["model.embed_tokens"]["bits"] == 8  # the embedding is 8-bit, the rest 4-bit
    assert q["model.layers.0.self_attn.q_proj"]["bits"] == 4
    assert default_gguf_path().name == "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_tokenizer_round_trips_and_specials(default_model):
    tok = default_model.tokenizer
    for text in ["Hello, world!", "numbers 12345 and 3.14", "  spaces\n\ttabs  ",
                 "ünïcödé — ✓ 日本語", "def f(x):\n    return x ** 2\n"]:
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode("<|im_start|>user")[0] == 1  # special tokens are single ids
    assert tok.encode("2024") == [tok.encode(d)[0] for d in "2024"]  # digits split singly


def test_chat_template_from_gguf(default_engine):
    ids = default_engine.encode_prompt("Hi", system="Be brief.")
    text = default_engine.tokenizer.decode(ids)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                    "<|im_start|>assistant\n")
    raw = default_engine.encode_prompt("Hi", raw=True)
    assert default_engine.tokenizer.decode(raw) == "Hi"


def _gguf_header(num_tensors: int, num_kv: int) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, num_tensors, num_kv)


CHILD = pytest.mark.subprocess  # past the header check, the reader runs in a child process


@pytest.mark.parametrize("name, data, reason", [
    ("magic", b"XXXX" + bytes(40), "(bad magic)"),
    pytest.param("empty", _gguf_header(0, 0), "(no model metadata)", marks=CHILD),
    # a real file cut short, and noise after a header: gguf-py's reader fails on them
    pytest.param("truncated", None, "(corrupt or truncated: ", marks=CHILD),
    pytest.param("garbage", _gguf_header(1, 2) + random.Random(0).randbytes(2000),
                 "(corrupt or truncated: ", marks=CHILD),
], ids=["magic", "empty", "truncated", "garbage"])
def test_corrupt_gguf_says_not_a_valid_gguf(tmp_path, name, data, reason):
    bad = tmp_path / f"{name}.gguf"
    bad.write_bytes(data if data is not None else default_gguf_path().read_bytes()[:100_000])
    with pytest.raises(ModelLoadError) as info:
        converted_dir(bad, root=tmp_path / "models")
    message = str(info.value)
    assert message.startswith(f"not a valid GGUF file: {bad} (")
    assert reason in message and "\n" not in message
    assert "Warning" not in message  # never the child's stray stderr (runpy)
    assert not (tmp_path / "models").exists() or not any((tmp_path / "models").iterdir())


@pytest.mark.subprocess  # each conversion runs in a child process
def test_a_new_conversion_removes_the_old_versions_of_its_file(tmp_path):
    """Converter version N's directory goes when N + 1 converts the same file; another
    file's, a directory kvchat did not write privately and unrelated names stay."""
    models = tmp_path / "models"
    models.mkdir(mode=0o700)
    digest = file_digest(default_gguf_path())[:16]
    stem = f"{default_gguf_path().stem}-{digest}"
    old, loose = models / f"{stem}-v{CONVERTER_VERSION - 1}", models / f"{stem}-v1"
    keep = [models / f"other-{digest}-v{CONVERTER_VERSION - 1}", loose, models / f"{stem}-vx"]
    for d in (old, *keep):
        d.mkdir(mode=0o700)
        (d / "config.json").write_text("{}")
        os.chmod(d / "config.json", 0o600)
    os.chmod(loose / "config.json", 0o666)  # not private: not ours to trust or remove
    out = converted_dir(default_gguf_path(), root=models)
    assert out.name == f"{stem}-v{CONVERTER_VERSION}"
    assert not old.exists() and all(d.exists() for d in keep)


def test_converted_dir_is_private_and_a_loose_one_is_redone(tmp_path):
    old = os.umask(0)
    try:
        out = converted_dir(default_gguf_path(), root=tmp_path / "models")
    finally:
        os.umask(old)
    assert is_private_tree(out, required="config.json")
    assert stat.S_IMODE((tmp_path / "models").stat().st_mode) == 0o700
    assert {p.name for p in out.iterdir()} == {
        "model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json",
        "generation_config.json"}
    config = out / "config.json"
    os.chmod(config, 0o666)  # as an older kvchat left it under umask 000: not trusted
    config.write_text("{}")
    assert converted_dir(default_gguf_path(), root=tmp_path / "models") == out
    assert json.loads(config.read_text())["model_type"] == "llama"
    assert is_private_tree(out, required="config.json")
    assert [p.name for p in (tmp_path / "models").iterdir()] == [out.name]
