"""Conversation persistence: round trip, listing order, atomic files, bad input."""

from __future__ import annotations

import json
import os
import stat

import pytest

from app.conversations import ConversationError, ConversationStore


@pytest.fixture
def store(tmp_path):
    return ConversationStore(tmp_path / "conversations")


def test_new_is_not_saved_until_save(store):
    conv = store.new(system_prompt="Be brief", model="default")
    assert store.list() == []
    conv.add("user", "What is the capital of France?")
    conv.add("assistant", "Paris.", finish_reason="stop", stats="8 tokens")
    store.save(conv)
    back = store.load(conv.id)
    assert back.system_prompt == "Be brief"
    assert back.model == "default"
    assert back.title == "What is the capital of France?"
    assert [(m.role, m.content) for m in back.messages] == [
        ("user", "What is the capital of France?"), ("assistant", "Paris.")]
    assert back.messages[1].meta == {"finish_reason": "stop", "stats": "8 tokens"}
    assert back.history() == [{"role": "user", "content": "What is the capital of France?"},
                              {"role": "assistant", "content": "Paris."}]


def test_files_are_private_and_atomic(store):
    conv = store.new()
    conv.add("user", "hi")
    path = store.save(conv)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(store.root.stat().st_mode) == 0o700
    assert [p.name for p in store.root.iterdir()] == [path.name]  # no temp file left behind


@pytest.mark.parametrize("mask", [0o000, 0o277])
def test_files_are_private_whatever_the_umask(tmp_path, mask):
    store = ConversationStore(tmp_path / "a" / "conversations")
    conv = store.new()
    conv.add("user", "hi")
    old = os.umask(mask)
    try:
        path = store.save(conv)
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(store.root.stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "a").stat().st_mode) == 0o700
    assert store.load(conv.id).messages[0].content == "hi"


def test_list_newest_first_and_delete(store):
    convs = []
    for i in range(3):
        conv = store.new()
        conv.add("user", f"question {i}")
        conv.updated = 1000.0 + i
        store.save(conv)
        convs.append(conv)
    assert [s.title for s in store.list()] == ["question 2", "question 1", "question 0"]
    assert store.delete(convs[1].id)
    assert not store.delete(convs[1].id)
    assert [s.id for s in store.list()] == [convs[2].id, convs[0].id]


def test_corrupt_and_foreign_files_are_skipped(store):
    conv = store.new()
    conv.add("user", "kept")
    store.save(conv)
    (store.root / "20240101-000000-abcdef.json").write_text("{not json")
    (store.root / "notes.json").write_text(json.dumps({"hello": 1}))
    assert [s.title for s in store.list()] == ["kept"]
    with pytest.raises(ConversationError, match="cannot read"):
        store.load("20240101-000000-abcdef")


def test_bad_ids_are_rejected(store):
    with pytest.raises(ConversationError, match="not a conversation id"):
        store.load("../../etc/passwd")
    with pytest.raises(ConversationError, match="no saved conversation"):
        store.load("20240101-000000-000000")


def test_long_title_is_shortened(store):
    conv = store.new()
    conv.add("user", "word " * 40)
    assert len(conv.title) == 60 and conv.title.endswith("…")


def test_wide_titles_are_cut_by_cells():
    from rich.cells import cell_len

    from app.conversations import TITLE_CELLS, fit_cells, make_title

    title = make_title("東京の天気について教えてください。" * 5)
    assert cell_len(title) <= TITLE_CELLS and title.endswith("…")
    assert fit_cells("🙂🙂🙂", 4) == "🙂…"
    assert fit_cells("short", 10) == "short"


def test_turns_delete_truncate_search_and_markdown(store):
    conv = store.new(system_prompt="Be brief")
    for q, a in (("one?", "first"), ("two?", "second"), ("three?", "third")):
        conv.add("user", q)
        conv.add("assistant", a, finish_reason="stop")
    assert conv.turn_span(3) == (2, 4) and conv.turn_span(2) == (2, 4)
    assert [m.content for m in conv.delete_turn(3)] == ["two?", "second"]
    assert [m.content for m in conv.messages] == ["one?", "first", "three?", "third"]
    conv.truncate(2)
    assert [m.content for m in conv.messages] == ["one?", "first"]
    conv.messages[1].meta["finish_reason"] = "cancelled"
    md = conv.to_markdown()
    assert md.startswith("# one?\n") and "> Be brief" in md
    assert "## You\n\none?" in md and "*(cancelled: partial answer)*" in md
    store.save(conv)
    other = store.new()
    other.add("user", "Quelle est la capitale ?")
    store.save(other)
    assert [s.id for s in store.list("FIRST")] == [conv.id]  # text, any case
    assert [s.id for s in store.list("capitale quelle")] == [other.id]  # title, every word
    assert store.list("nowhere") == []


def test_generation_params_are_saved_with_the_chat(store):
    conv = store.new()
    conv.add("user", "hi")
    conv.params = {"temperature": 0.7}
    store.save(conv)
    assert store.load(conv.id).params == {"temperature": 0.7}
