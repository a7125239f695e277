"""App settings: remembered model, theme and KV cache format; private atomic file, bad files
ignored."""

from __future__ import annotations

import json
import os
import stat

import pytest

from app import settings
from app.settings import AppSettings


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCHAT_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def test_settings_remember_the_last_model(home):
    assert settings.last_model() is None
    settings.remember_model("org/tiny")
    settings.save_settings(theme="textual-light")
    assert settings.last_model() == "org/tiny"
    assert settings.load_settings() == AppSettings(theme="textual-light", last_model="org/tiny")
    assert json.loads(settings.settings_path().read_text()) == {
        "last_model": "org/tiny", "theme": "textual-light"}
    settings.settings_path().write_text("[broken")
    assert settings.last_model() is None


def test_file_is_private_whatever_the_umask(home):
    old = os.umask(0)
    try:
        settings.save_settings(theme="textual-dark")
    finally:
        os.umask(old)
    assert stat.S_IMODE(settings.settings_path().stat().st_mode) == 0o600
    assert stat.S_IMODE(home.stat().st_mode) == 0o700
    assert [p.name for p in home.iterdir()] == ["settings.json"]  # no temp file left


def test_a_file_others_can_write_is_not_trusted(home):
    settings.remember_model("org/tiny")
    os.chmod(settings.settings_path(), 0o666)
    assert settings.last_model() is None
    settings.remember_model("org/other")  # rewritten privately
    assert stat.S_IMODE(settings.settings_path().stat().st_mode) == 0o600
    assert settings.last_model() == "org/other"


def test_unknown_keys_are_kept_and_bad_values_dropped(home):
    home.mkdir(mode=0o700)
    settings.settings_path().write_text(json.dumps({"future": [1], "theme": 3}))
    assert settings.load_settings() == AppSettings(extra={"future": [1]})
    settings.save_settings(theme="textual-light")
    assert json.loads(settings.settings_path().read_text()) == {
        "future": [1], "theme": "textual-light"}
    with pytest.raises(TypeError):
        settings.save_settings(colour="red")


def test_kv_cache_format_is_saved_with_the_others(home):
    settings.remember_model("org/tiny")
    settings.save_settings(kv_cache="k8v4")
    assert settings.load_settings() == AppSettings(last_model="org/tiny", kv_cache="k8v4")
    assert settings.kv_cache_bits(settings.load_settings().kv_cache) == (8, 4)
    assert settings.kv_cache_bits("float") == (None, None)
    # a format this version does not know (a newer one's) is kept but not applied
    settings.save_settings(kv_cache="q2")
    assert settings.load_settings().kv_cache == "q2"
    assert settings.kv_cache_bits("q2") is None and settings.kv_cache_bits(None) is None


def test_generation_defaults_and_the_last_chat(home):
    from app.settings import GenerationSettings

    assert settings.generation_defaults() == GenerationSettings()
    settings.save_settings(generation={"temperature": 0.8, "top_p": 2.0, "max_tokens": 64},
                           last_conversation="20260101-000000-abcdef")
    saved = settings.generation_defaults()
    assert (saved.temperature, saved.top_p, saved.max_tokens) == (0.8, 0.0, 64)  # bad top_p
    assert settings.load_settings().last_conversation == "20260101-000000-abcdef"
    with pytest.raises(ValueError, match="temperature"):
        GenerationSettings(temperature=-1)
    with pytest.raises(ValueError, match="max tokens"):
        GenerationSettings(max_tokens=0)
    base = GenerationSettings()
    assert GenerationSettings(temperature=0.5).changes(base) == {"temperature": 0.5}
