"""Fingerprints hash contents, not paths."""

from __future__ import annotations

import shutil

from engine.model.fingerprint import model_fingerprint, tokenizer_fingerprint


def make_dir(path, weights=b"w" * 1000, tok=b'{"v": 1}'):
    path.mkdir()
    (path / "model.safetensors").write_bytes(weights)
    (path / "config.json").write_text('{"model_type": "llama"}')
    (path / "tokenizer.json").write_bytes(tok)
    return path


def test_same_content_elsewhere_same_fingerprint(tmp_path):
    a = make_dir(tmp_path / "a")
    b = tmp_path / "b"
    shutil.copytree(a, b)
    assert model_fingerprint(a) == model_fingerprint(b)
    assert tokenizer_fingerprint(a) == tokenizer_fingerprint(b)


def test_one_changed_byte_changes_it(tmp_path):
    a = make_dir(tmp_path / "a")
    before = model_fingerprint(a)
    tok_before = tokenizer_fingerprint(a)
    (a / "model.safetensors").write_bytes(b"w" * 999 + b"x")
    assert model_fingerprint(a) != before
    assert tokenizer_fingerprint(a) == tok_before  # weights are not the tokenizer
    (a / "tokenizer.json").write_bytes(b'{"v": 2}')
    assert tokenizer_fingerprint(a) != tok_before


def test_default_model_fingerprint_is_stable(default_model):
    assert default_model.fingerprint == model_fingerprint(default_model.path)
    assert len(default_model.fingerprint) == 64
