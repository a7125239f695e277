"""Pilot tests of the chat UI on a scripted engine: fast, no model needed.

Behaviour with the real engine (stream, cancel and blocks back, switch model, a huge
paste) is in test_tui.py; looks are in test_tui_snapshots.py.
"""

from __future__ import annotations

import asyncio

import pytest
from test_tui_fakes import FakeEngine, long_reply

from app.conversations import ConversationStore
from app.settings import GenerationSettings
from app.tui.app import ChatApp
from app.tui.screens.conversations import ConversationsScreen
from app.tui.screens.dialogs import ConfirmScreen, SystemPromptScreen
from app.tui.screens.models import ModelsScreen
from app.tui.widgets.cache_panel import CachePanel
from app.tui.widgets.prompt_input import PromptInput
from app.tui.widgets.transcript import MessageBox

SIZE = (110, 34)


async def wait_for(pilot, predicate, timeout: float = 30.0) -> None:
    # generous: an upper bound only, and CI machines can be busy
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not predicate():
        assert loop.time() < end, "timed out waiting for the UI"
        await pilot.pause(0.02)


@pytest.fixture
def store(tmp_path):
    return ConversationStore(tmp_path / "conversations")


def make_app(store, engine=None, **kwargs) -> ChatApp:
    engines = []

    def factory(spec, kv_cache=None):
        e = engine if engine is not None and not engines else FakeEngine(kv_cache=kv_cache)
        engines.append(e)
        return e

    app = ChatApp(engine_factory=factory, store=store, remember=False, **kwargs)
    app.engines = engines
    app.notices = record_notices(app)
    return app


def record_notices(app) -> list[str]:
    """Every notification's text, as it passes through the public `App.notify`.

    Screens and widgets notify through ``self.app.notify`` too, so wrapping it on the
    instance sees them all without reading Textual's private notification store.
    """
    seen: list[str] = []
    notify = app.notify

    def recording(message: str, **kwargs) -> None:
        seen.append(message)
        notify(message, **kwargs)

    app.notify = recording
    return seen


def boxes(app) -> list[MessageBox]:
    return list(app.chat.query(MessageBox))


async def ask(pilot, app, text: str) -> None:
    app.chat.query_one(PromptInput).text = text
    await pilot.press("enter")
    await wait_for(pilot, lambda: not app.chat.generating)


async def test_send_streams_and_saves(store):
    app = make_app(store, FakeEngine(delay=0.005))
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.engine is not None)
        assert app.engine.started
        await pilot.press(*"What is the capital?")
        await pilot.press("ctrl+j")
        await pilot.press(*"Be brief")
        assert app.chat.query_one(PromptInput).text == "What is the capital?\nBe brief"
        await pilot.press("enter")
        await wait_for(pilot, lambda: not app.chat.generating)
        await pilot.pause()
        user, answer = boxes(app)
        assert user.text == "What is the capital?\nBe brief"
        assert answer.text == "The capital of France is **Paris**."
        assert "tok/s" in str(answer.query_one(".stats").render())
        assert app.chat.query_one(PromptInput).text == ""
        assert app.chat.query_one(CachePanel).last_turn == (6, 6)  # the fake: one token a word
        await ask(pilot, app, "second")
        assert app.engine.histories[-1] == [
            {"role": "user", "content": "What is the capital?\nBe brief"},
            {"role": "assistant", "content": "The capital of France is **Paris**."}]
    [saved] = store.list()
    conv = store.load(saved.id)
    assert [m.role for m in conv.messages] == ["user", "assistant"] * 2
    assert conv.messages[1].meta["finish_reason"] == "stop"
    assert app.engines[0].stopped  # quitting shut the engine down


async def start_answer(pilot, app) -> None:
    """Send "go" once the engine is up and wait until the answer has begun streaming."""
    await wait_for(pilot, lambda: app.engine is not None)
    app.chat.query_one(PromptInput).text = "go"
    await pilot.press("enter")
    await wait_for(pilot, lambda: len(boxes(app)) == 2 and boxes(app)[1].text)


async def test_escape_cancels_and_shows_released_blocks(store):
    engine = FakeEngine(long_reply(400), delay=0.01)
    app = make_app(store, engine)
    async with app.run_test(size=SIZE) as pilot:
        await start_answer(pilot, app)
        await pilot.press("escape")
        await wait_for(pilot, lambda: not app.chat.generating)
        stats = str(boxes(app)[1].query_one(".stats").render())
        assert stats.startswith("cancelled — 4 blocks released · the partial answer stays")
        assert "cancelled, partial answer" in str(boxes(app)[1].query_one(".role").render())
        assert engine.cancelled == {0}
    conv = store.load(store.list()[0].id)
    assert conv.messages[1].meta["finish_reason"] == "cancelled"


async def test_ctrl_c_cancels_first_then_quits(store):
    engine = FakeEngine(long_reply(400), delay=0.01)
    app = make_app(store, engine)
    async with app.run_test(size=SIZE) as pilot:
        await start_answer(pilot, app)
        await pilot.press("ctrl+c")
        await wait_for(pilot, lambda: not app.chat.generating)
        assert app.is_running
        await pilot.press("ctrl+c")
        await wait_for(pilot, lambda: not app.is_running)
    assert engine.stopped
    assert len(store.list()) == 1  # the chat was saved


async def test_empty_and_too_long_prompts_keep_the_chat(store):
    engine = FakeEngine(max_prompt_tokens=50)
    app = make_app(store, engine)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.engine is not None)
        await pilot.press("space", "enter")
        await pilot.pause()
        assert not boxes(app) and not app.chat.generating
        assert any("empty" in n for n in app.notices)
        await ask(pilot, app, "hello")
        await ask(pilot, app, "word " * 5000)
        await pilot.pause()
        assert len(boxes(app)) == 2  # the refused prompt is not shown as part of the chat
        assert any("the prompt has" in n for n in app.notices)
        # offered as a document instead (test_tui_documents.py); Esc declines, and the
        # prompt is back in the input whole, to be shortened
        await wait_for(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        await pilot.press("escape")
        await wait_for(pilot, lambda: app.screen is app.chat)
        assert app.chat.query_one(PromptInput).text == "word " * 5000
        await ask(pilot, app, "still here?")
        assert len(boxes(app)) == 4
    conv = store.load(store.list()[0].id)
    assert [m.content for m in conv.messages if m.role == "user"] == ["hello", "still here?"]


async def test_open_a_saved_chat_and_delete_it(store):
    conv = store.new(system_prompt="Be terse")
    conv.add("user", "saved question")
    conv.add("assistant", "saved answer", stats="3 tokens")
    store.save(conv)
    app = make_app(store)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.engine is not None)
        await pilot.press("f4")
        await wait_for(pilot, lambda: isinstance(app.screen, ConversationsScreen))
        await pilot.press("enter")
        await wait_for(pilot, lambda: len(boxes(app)) == 2)
        assert [b.text for b in boxes(app)] == ["saved question", "saved answer"]
        assert app.chat.conversation.system_prompt == "Be terse"
        await ask(pilot, app, "follow up")
        assert app.engine.histories[-1][0]["content"] == "saved question"
        assert len(store.load(conv.id).messages) == 4
        # delete it from the list: the chat view starts afresh
        await pilot.press("f4")
        await wait_for(pilot, lambda: isinstance(app.screen, ConversationsScreen))
        await pilot.press("d")
        await wait_for(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        await pilot.press("y")
        await wait_for(pilot, lambda: isinstance(app.screen, ConversationsScreen))
        await pilot.press("escape")
        await wait_for(pilot, lambda: not boxes(app))
    assert store.list() == []


async def test_new_chat_and_system_prompt(store):
    engine = FakeEngine()
    app = make_app(store, engine)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.engine is not None)
        await ask(pilot, app, "one")
        first_id = app.chat.conversation.id
        await pilot.press("ctrl+n")
        await wait_for(pilot, lambda: not boxes(app))
        assert app.chat.conversation.id != first_id
        await pilot.press("f5")
        await wait_for(pilot, lambda: isinstance(app.screen, SystemPromptScreen))
        await pilot.press(*"Answer in French")
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: app.screen is app.chat)
        assert app.chat.conversation.system_prompt == "Answer in French"
        await ask(pilot, app, "two")
        second_id = app.chat.conversation.id
    assert len(store.list()) == 2
    assert store.load(second_id).system_prompt == "Answer in French"


async def test_theme_cache_panel_and_palette(store):
    app = make_app(store)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.engine is not None)
        panel = app.chat.query_one(CachePanel)
        assert panel.display
        await pilot.press("f2")
        assert not panel.display
        dark = app.current_theme.dark
        await pilot.press("ctrl+t")
        assert app.current_theme.dark is not dark
        # the command palette lists the app's commands and runs them
        await pilot.press("ctrl+p")
        await pilot.press(*"cache panel")
        await pilot.pause(0.3)
        await pilot.press("enter")
        await wait_for(pilot, lambda: panel.display)


async def test_model_that_fails_to_load_keeps_the_chat(store, tmp_path):
    bad = tmp_path / "bad-model"
    bad.mkdir()
    (bad / "config.json").write_text('{"model_type": "not-a-model"}')

    def factory(spec, kv_cache=None):
        if spec is None:
            return FakeEngine()
        from app.tui.app import default_engine_factory

        return default_engine_factory(spec, kv_cache=kv_cache)

    app = ChatApp(engine_factory=factory, store=store, remember=False)
    notices = record_notices(app)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.engine is not None)
        first = app.engine
        await ask(pilot, app, "kept")
        app.load_model(str(bad))
        await wait_for(pilot, lambda: not app.model_loading)
        assert app.engine is first and not first.stopped
        assert any("not supported" in n for n in notices)
        assert len(boxes(app)) == 2


async def test_last_model_failing_falls_back_to_default(store, monkeypatch):
    monkeypatch.setattr("app.settings.last_model", lambda: "org/gone")
    specs = []

    def factory(spec, kv_cache=None):
        specs.append(spec)
        if spec is not None:
            from engine.errors import ModelLoadError

            raise ModelLoadError(f"model {spec!r} is not in the local Hugging Face cache")
        return FakeEngine()

    app = ChatApp(engine_factory=factory, store=store, remember=True)
    monkeypatch.setattr("app.settings.remember_model", lambda name: None)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.engine is not None)
        assert specs == ["org/gone", None]
        assert app.model_name == "default"


async def test_models_screen_download_offline_and_delete(store, tmp_path, monkeypatch):
    from test_models_hub import add_hub_repo

    cache = tmp_path / "hub"
    cache.mkdir()
    add_hub_repo(cache, "org/tiny", {"config.json": b"{}", "w.bin": b"x" * 2048})
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    app = make_app(store)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.engine is not None)
        await pilot.press("f3")
        await wait_for(pilot, lambda: isinstance(app.screen, ModelsScreen))
        screen = app.screen
        assert list(screen.models) == ["default", "org/tiny"]
        # unknown repo while offline: a clear message, the screen stays
        await pilot.click("#repo-id")
        await pilot.press(*"org/does-not-exist", "enter")
        status = screen.query_one("#download-status")
        await wait_for(pilot, lambda: "offline" in str(status.render()))
        assert "org/does-not-exist is not in the local hub cache" in str(status.render())
        await pilot.click("#repo-id")
        await pilot.press(*" bad id", "enter")
        await wait_for(pilot, lambda: "is not a repo id" in str(status.render()))
        # delete org/tiny
        screen.query_one("DataTable").focus()
        await pilot.press("down", "ctrl+d")
        await wait_for(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        await pilot.press("y")
        await wait_for(pilot, lambda: list(screen.models) == ["default"])
        assert not (cache / "models--org--tiny").exists()
        # the embedded default cannot be deleted
        await pilot.press("ctrl+d")
        assert "cannot be deleted" in str(status.render())
        # Enter on the model already loaded keeps it (test_tui.py switches models)
        old = app.engine
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.screen is app.chat)
        assert app.engine is old and not old.stopped and app.model_name == "default"


def test_chat_app_provides_what_the_chat_screen_needs(store):
    """The screen types its app as `ChatHost`; the app must have every member."""
    from app.tui.screens.chat import ChatHost

    app = make_app(store)
    for name in ChatHost.__annotations__:
        assert hasattr(app, name), name
    assert app.max_tokens is None  # not given: the chat's settings decide
    assert app.sampling().max_tokens == GenerationSettings().max_tokens
