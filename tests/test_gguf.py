"""GGUF conversion of the embedded default model: names, config, tokenizer, template."""

from __future__ import annotations

import json

import pytest

from engine.errors import ModelLoadError
from engine.model.gguf import rename_tensor
from engine.model.loader import default_gguf_path, resolve_model_path


def test_tensor_names():
    assert rename_tensor("token_embd.weight") == "model.embed_tokens.weight"
    assert rename_tensor("blk.7.attn_output.scales") == "model.layers.7.self_attn.o_proj.scales"
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
