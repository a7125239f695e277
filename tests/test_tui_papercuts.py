"""The newcomer's papercuts of issue 32 (defects 5-10), each with the keys that showed it."""

from __future__ import annotations

import threading

import pytest
from test_tui_app import SIZE, boxes, make_app, wait_for
from test_tui_fakes import FakeEngine, long_reply
from test_tui_soak import post_keys

from app.conversations import ConversationStore
from app.settings import GenerationSettings
from app.tui.export import close_fences, markdown
from app.tui.screens.conversations import ConversationsScreen
from app.tui.screens.dialogs import ConfirmScreen, TextInputScreen
from app.tui.screens.settings import SettingsScreen
from app.tui.settings_host import describe_generation
from app.tui.widgets.prompt_input import LARGE_PASTE_CHARS, PromptInput

DEFAULT_NAME = "SmolLM2-135M-Instruct"  # the embedded default's own name


@pytest.fixture
def store(tmp_path):
    return ConversationStore(tmp_path / "conversations")


async def test_paste_dialog_shows_its_keys(store):
    app = make_app(store)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.engine is not None)
        prompt = app.chat.query_one(PromptInput)
        prompt.post_message(PromptInput.LargePaste(prompt, "x" * LARGE_PASTE_CHARS))
        await wait_for(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        question = str(app.screen.query_one(".question").render())
        assert question.endswith("[Enter] yes / [Esc] no")


def save_lighthouse_chat(store) -> None:
    """One saved chat for F4's search to find as "lighthouse"."""
    conv = store.new()
    conv.add("user", "about lighthouses")
    conv.add("assistant", "They guide ships.")
    store.save(conv)


async def test_fast_slash_query_goes_to_the_search_box(store):
    """"/lighthouse" typed in one burst: the keys after "/" must not reach the list, whose
    one-letter keys act on the selected chat (e exported it)."""
    save_lighthouse_chat(store)
    app = make_app(store)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.engine is not None)
        await pilot.press("f4")
        await wait_for(pilot, lambda: isinstance(app.screen, ConversationsScreen))
        screen = app.screen
        post_keys(app, "slash", *"lighthouse", "slash")
        await wait_for(pilot, lambda: screen.query_text == "lighthouse/")
        await pilot.pause(0.05)
        assert app.screen is screen  # no export (e), rename or delete dialog opened
        assert not isinstance(app.screen, TextInputScreen)


async def test_f4_and_a_query_in_one_burst_search_the_list(store):
    """F4 and "/lighthouse" typed together: the list opens before the keys after F4 are
    handed on (they landed in the chat's prompt), and "/" moves to the search box (the
    box had the focus first, so "/" was search text)."""
    save_lighthouse_chat(store)
    app = make_app(store)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.engine is not None)
        post_keys(app, "f4", "slash", *"lighthouse")
        await wait_for(pilot, lambda: isinstance(app.screen, ConversationsScreen)
                       and app.screen.query_text == "lighthouse")
        assert app.chat.query_one(PromptInput).text == ""


def test_export_closes_an_open_code_fence_and_names_the_model(store):
    conv = store.new()
    conv.model = "default"  # as chats were saved before
    conv.add("user", "show code")
    conv.add("assistant", "Here:\n```python\nprint('cut off", finish_reason="cancelled")
    conv.add("user", "and more")
    conv.add("assistant", "~~~~\nx\n~~~\n")
    text = markdown(conv)
    assert f"kvchat · {DEFAULT_NAME} ·" in text
    assert "print('cut off\n```\n" in text
    assert "~~~\n~~~~\n" in text  # a shorter fence does not close a longer one
    assert close_fences("```\nclosed\n```") == "```\nclosed\n```"
    assert conv.messages[1].content.endswith("cut off")  # the chat itself is unchanged


async def test_answers_are_saved_with_the_models_name(store):
    app = make_app(store)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.engine is not None)
        app.chat.query_one(PromptInput).text = "hi"
        await pilot.press("enter")
        await wait_for(pilot, lambda: len(boxes(app)) == 2 and not app.chat.generating)
    assert store.load(store.list()[0].id).model == DEFAULT_NAME


@pytest.mark.parametrize("width", [60, 80, 130])
async def test_status_line_keeps_the_generating_state(store, width):
    conv = store.new(system_prompt="Be brief.")
    app = make_app(store, FakeEngine(long_reply(400), delay=0.01),
                   conversation_id=conv.id)
    store.save(conv)
    async with app.run_test(size=(width, 30)) as pilot:
        await wait_for(pilot, lambda: app.engine is not None)
        app.chat.query_one(PromptInput).text = "go"
        await pilot.press("enter")
        await wait_for(pilot, lambda: len(boxes(app)) == 2 and boxes(app)[1].text)
        status = app.chat.query_one("#status")
        assert str(status.render()).startswith("generating — Esc cancels")
        assert status.content_region.width >= len("generating — Esc cancels")
        await pilot.press("escape")


async def test_settings_cursor_starts_on_the_format_in_use(store):
    app = make_app(store)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.engine is not None)
        app.kv_cache = "q8"
        await pilot.press("f6")
        await wait_for(pilot, lambda: isinstance(app.screen, SettingsScreen))
        await pilot.press("enter")  # presses the button under the cursor
        assert app.screen.selected() == "q8"
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: app.screen is app.chat)
        assert app.kv_cache == "q8" and len(app.engines) == 1  # no reload


def test_top_p_one_is_off():
    assert "top-p off" in describe_generation(GenerationSettings(top_p=1.0))
    assert "top-p off" in describe_generation(GenerationSettings(top_p=0.0))
    assert "top-p 0.9" in describe_generation(GenerationSettings(top_p=0.9))


async def test_leading_blank_lines_are_not_sent(store):
    engine = FakeEngine()
    app = make_app(store, engine)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.engine is not None)
        app.chat.query_one(PromptInput).text = "\n  \nhello\n  indented"
        await pilot.press("enter")
        await wait_for(pilot, lambda: len(boxes(app)) == 2 and not app.chat.generating)
        assert boxes(app)[0].text == "hello\n  indented"


async def test_prompt_history_and_clear(store):
    app = make_app(store)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.engine is not None)
        prompt = app.chat.query_one(PromptInput)
        for text in ("first", "second"):
            prompt.text = text
            await pilot.press("enter")
            await wait_for(pilot, lambda: not app.chat.generating)
        await pilot.press("ctrl+r")
        assert prompt.text == "second"
        await pilot.press("ctrl+r")
        assert prompt.text == "first"
        await pilot.press("ctrl+l")
        assert prompt.text == ""


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A home folder with no downloads folder: screenshots land in it."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("XDG_DOWNLOAD_DIR", raising=False)
    return home


async def test_screenshot_without_a_downloads_folder(store, home):
    app = make_app(store)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.engine is not None)
        app.deliver_screenshot()
        await wait_for(pilot, lambda: list(home.glob("*.svg")), timeout=10)
        # Textual's save thread (not a daemon) then hands DeliveryComplete to the app's
        # loop and waits for it: leaving the app first left it waiting for ever, and the
        # test process hung at exit (seen once in a full run)
        await wait_for(pilot, lambda: not any("save_file_thread" in t.name
                                              for t in threading.enumerate()), timeout=10)


async def test_an_answer_that_loops_is_stopped_and_cut(store):
    loop = "Boil an egg: put it in water."
    engine = FakeEngine("Here is how. " + " ".join([loop] * 60), delay=0.002)
    app = make_app(store, engine)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.engine is not None)
        app.chat.query_one(PromptInput).text = "How do I boil an egg?"
        await pilot.press("enter")
        await wait_for(pilot, lambda: len(boxes(app)) == 2 and not app.chat.generating)
        answer = boxes(app)[1]
        assert engine.cancelled == {0}  # stopped long before its 60 copies
        assert answer.text.startswith("Here is how. Boil an egg")
        assert answer.text.count("Boil an egg") == 1
        assert "began repeating itself" in str(answer.query_one(".stats").render())
    saved = store.load(store.list()[0].id).messages[1]
    assert saved.meta["finish_reason"] == "loop" and saved.content == answer.text


async def test_deleting_the_last_turn_goes_back_to_the_newest_message(store):
    """Defect 10: ↑ then d on the last answer left the transcript scrolled mid-way up the
    answer before (the removed box handed its focus there, centred)."""
    from app.tui.widgets.transcript import Transcript

    app = make_app(store, FakeEngine(long_reply(300)))
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.engine is not None)
        prompt = app.chat.query_one(PromptInput)
        for question in ("one", "two", "three"):
            prompt.text = question
            await pilot.press("enter")
            await wait_for(pilot, lambda: not app.chat.generating)
        transcript = app.chat.query_one(Transcript)
        await pilot.press("up")
        await wait_for(pilot, lambda: app.focused is boxes(app)[-1])
        await pilot.press("d")
        await wait_for(pilot, lambda: len(boxes(app)) == 4 and app.focused is prompt)
        await pilot.pause(0.5)  # a scroll to the box before would have run by now
        await wait_for(pilot, lambda: transcript.max_scroll_y > 0
                       and transcript.scroll_y == transcript.max_scroll_y)
        assert transcript.scroll_y == transcript.max_scroll_y  # and it stays there


async def test_a_quit_waits_for_a_screenshot_being_written(store, home, monkeypatch):
    """A screenshot taken just before a quit: the quit waits until it is on disk, so the
    file is whole and Textual's save thread (not a daemon) does not outlive the app."""
    app = make_app(store)
    release = threading.Event()
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.engine is not None)
        handed_over = app._driver._delivery_complete

        def slow_disk(*args, **kwargs):  # the file is written; its hand-over is held
            release.wait(10)
            handed_over(*args, **kwargs)

        monkeypatch.setattr(app._driver, "_delivery_complete", slow_disk)
        app.deliver_screenshot()
        await app.action_quit()
        await pilot.pause(0.4)
        assert app.deliveries and app.is_running  # the quit is waiting for it
        release.set()
        await wait_for(pilot, lambda: not app.is_running, timeout=10)
    assert [p.stat().st_size > 1000 for p in home.glob("*.svg")] == [True]
    for thread in threading.enumerate():
        if "save_file_thread" in thread.name:
            thread.join(5)
            assert not thread.is_alive()
