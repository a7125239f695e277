"""Fingerprints hash contents, not paths."""

from __future__ import annotations

import json
import os
import shutil
import stat

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


def test_memo_is_private_and_ignored_when_others_can_write_it(tmp_path, monkeypatch):
    from engine.model import fingerprint

    monkeypatch.setenv("KVCHAT_HOME", str(tmp_path / "home"))
    a = make_dir(tmp_path / "a")
    honest = fingerprint.file_digest(a / "model.safetensors")
    memo_path = tmp_path / "home" / "fingerprints.json"
    assert stat.S_IMODE(memo_path.stat().st_mode) == 0o600
    # a forged memo that anyone could have written is not believed
    memo = json.loads(memo_path.read_text())
    memo = {key: "0" * 64 for key in memo}
    memo_path.write_text(json.dumps(memo))
    os.chmod(memo_path, 0o666)
    assert fingerprint.file_digest(a / "model.safetensors") == honest
    assert stat.S_IMODE(memo_path.stat().st_mode) == 0o600  # recomputed and rewritten privately
    assert set(json.loads(memo_path.read_text()).values()) == {honest}
    # the same forged memo kept private is trusted: that is what a memo is for
    memo_path.write_text(json.dumps(memo))
    assert fingerprint.file_digest(a / "model.safetensors") == "0" * 64
