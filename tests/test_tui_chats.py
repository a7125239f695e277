"""Pilot tests of chat management: the last chat reopened at start, rename, search, export,
and F4's columns with wide titles."""

from __future__ import annotations

import pytest
from rich.cells import cell_len
from test_tui_app import SIZE, ask, boxes, make_app, store, wait_for
from test_tui_fakes import FakeEngine
from textual.widgets import Input

from app.tui.app import ChatApp
from app.tui.screens.conversations import ConversationsScreen
from app.tui.screens.dialogs import TextInputScreen

__all__ = ["store"]  # the fixture, shared with test_tui_app


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCHAT_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def remembering_app(store) -> ChatApp:
    return ChatApp(engine_factory=lambda spec, kv_cache=None: FakeEngine(), store=store,
                   remember=True)


async def test_the_last_chat_is_reopened_at_start(store, home):
    app = remembering_app(store)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.engine is not None)
        await ask(pilot, app, "remember me")
        cid = app.chat.conversation.id
    app = remembering_app(store)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.engine is not None)
        assert app.chat.conversation.id == cid and len(boxes(app)) == 2
        await pilot.press("ctrl+n")  # a new, empty chat at quit: the next start is empty
        await wait_for(pilot, lambda: not boxes(app))
    app = remembering_app(store)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.engine is not None)
        assert not boxes(app) and app.chat.conversation.id != cid
        store.delete(cid)  # a remembered chat deleted since: quietly a new one


def table_titles(screen) -> list[str]:
    table = screen.query_one("DataTable")
    return [str(table.get_row_at(i)[0]) for i in range(table.row_count)]


async def test_search_rename_and_export_in_the_list(store, tmp_path):
    for q in ("Bread recipes please", "東京の天気について教えてください。とても長い質問です。" * 3,
              "Rust lifetimes 🙂🙂"):
        conv = store.new()
        conv.add("user", q)
        conv.add("assistant", f"about {q.split()[0]}: sourdough" if "Bread" in q else "ok")
        store.save(conv)
    app = make_app(store)
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_for(pilot, lambda: app.engine is not None)
        await pilot.press("f4")
        await wait_for(pilot, lambda: isinstance(app.screen, ConversationsScreen))
        screen = app.screen
        widths = {cell_len(t) for t in table_titles(screen)}
        assert max(widths) <= screen.title_cells()  # wide titles cut by cells
        await pilot.press("slash", *"sourdough")  # text, not only titles
        await wait_for(pilot, lambda: len(table_titles(screen)) == 1)
        assert table_titles(screen) == ["Bread recipes please"]
        await pilot.press("down")  # from the search box to the list (as Enter)
        assert not isinstance(app.screen.focused, Input)
        await pilot.press("r")
        await wait_for(pilot, lambda: isinstance(app.screen, TextInputScreen))
        await pilot.press(*"Baking", "enter")
        await wait_for(pilot, lambda: app.screen is screen)
        assert table_titles(screen) == ["Baking"]  # still matches "sourdough"
        target = tmp_path / "out.md"
        await pilot.press("e")
        await wait_for(pilot, lambda: isinstance(app.screen, TextInputScreen))
        app.screen.query_one("Input").value = str(target)
        await pilot.press("enter")
        await wait_for(pilot, target.exists)
        assert target.read_text().startswith("# Baking\n")
        await pilot.press("enter")  # open it
        await wait_for(pilot, lambda: app.chat.conversation.title == "Baking")


async def test_rename_and_export_the_chat_on_screen(store, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    app = make_app(store)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.engine is not None)
        await ask(pilot, app, "What is a KV cache?")
        app.action_rename_chat()
        await wait_for(pilot, lambda: isinstance(app.screen, TextInputScreen))
        await pilot.press(*"KV notes", "enter")
        await wait_for(pilot, lambda: app.screen is app.chat)
        app.action_export_chat()
        await wait_for(pilot, lambda: isinstance(app.screen, TextInputScreen))
        await pilot.press("enter")  # the default path, in the home directory
        cid = app.chat.conversation.id
        target = tmp_path / f"kvchat-kv-notes-{cid}.md"
        await pilot.pause(0.2)
        assert target.exists(), (app.notices, list(tmp_path.iterdir()))
    assert store.load(cid).title == "KV notes"
    assert "## Assistant\n\nThe capital of France is **Paris**." in target.read_text()
