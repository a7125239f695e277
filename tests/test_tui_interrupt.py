"""Ctrl+C, Esc and quitting against a question on its way, being shown, queued or answered.

Keys are posted to the app together (`post_keys`), as a terminal delivers a fast typist's
keys: the second arrives before the first has been handled. The scripted engine is in
test_tui_fakes.py; test_tui_soak.py runs random timings of the same keys.
"""

from __future__ import annotations

import re
import threading

import pytest
from test_tui_app import SIZE, boxes, make_app, record_notices, wait_for
from test_tui_fakes import FakeEngine, long_reply
from test_tui_soak import post_keys, until

from app.conversations import ConversationStore
from app.tui.app import ChatApp
from app.tui.widgets.prompt_input import PromptInput
from app.tui.widgets.transcript import MessageBox

LONG = long_reply(400)


@pytest.fixture
def store(tmp_path):
    return ConversationStore(tmp_path / "conversations")


def prompt_of(app) -> PromptInput:
    return app.chat.query_one(PromptInput)


def slow_loading_app(store, engine) -> tuple[ChatApp, threading.Event]:
    """An app whose model load ends when the returned event is set."""
    loaded = threading.Event()

    def factory(spec, kv_cache=None):
        loaded.wait(30)
        return engine

    app = ChatApp(engine_factory=factory, store=store, remember=False)
    app.notices = record_notices(app)
    return app, loaded


async def test_ctrl_c_right_after_enter_cancels_the_question(store):
    """Ctrl+C while the question is on its way or being shown: it counts as running, so
    the question is cancelled (back in the prompt), the app goes on."""
    engine = FakeEngine(LONG, delay=0.01)
    app = make_app(store, engine)
    app.double_ctrl_c_s = 0.0  # each press decided alone
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.engine is not None)
        prompt_of(app).text = "first question"
        post_keys(app, "enter", "ctrl+c")
        await wait_for(pilot, lambda: not app.chat.generating)
        await pilot.pause()
        assert app.is_running
        assert prompt_of(app).text == "first question"
        assert not boxes(app)
        assert engine.submitted == []  # it never reached the engine
        await pilot.pause(0.05)
        # the same once the Enter has been handled (the boxes being mounted)
        await pilot.press("enter")
        post_keys(app, "ctrl+c")
        await wait_for(pilot, lambda: not app.chat.generating)
        assert app.is_running


@pytest.mark.parametrize("keys", [("enter", "ctrl+c", "ctrl+c"), ("enter", "ctrl+q")])
async def test_double_ctrl_c_right_after_enter_quits_cleanly(store, keys):
    """Quitting while the question is being mounted waits for it: no widget is queried
    after the screen is gone (NoMatches / MountError), exit status 0."""
    engine = FakeEngine(LONG, delay=0.01)
    app = make_app(store, engine)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.engine is not None)
        prompt_of(app).text = "bye"
        post_keys(app, *keys)
        await until(lambda: not app.is_running)
        del pilot
    assert app.return_code == 0
    assert engine.stopped


async def test_quit_while_the_model_loads_stops_the_loaded_engine(store):
    """The engine a load finishes after quit began is shut down (its thread joined), not
    left running to the interpreter's exit (the exit-134 abort). A guard: the race it
    had (quit between the loader's check and the install) shows in the soak's seed 0."""
    engine = FakeEngine()
    app, loaded = slow_loading_app(store, engine)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause(0.05)
        post_keys(app, "ctrl+q")
        await wait_for(pilot, lambda: app.closing)
        loaded.set()
        await until(lambda: not app.is_running)
        del pilot
    assert engine.started and engine.stopped
    assert app.engine is None and app.return_code == 0


async def test_question_sent_while_loading_is_answered_when_ready(store):
    engine = FakeEngine("Paris.")
    app, loaded = slow_loading_app(store, engine)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause(0.05)
        prompt_of(app).text = "capital of France?"
        await pilot.press("enter")
        await wait_for(pilot, lambda: len(boxes(app)) == 2)
        status = str(app.chat.query_one("#status").render())
        assert status.startswith("question queued: sent when the model is loaded")
        assert "sent when it is ready" in str(boxes(app)[1].query_one(".stats").render())
        assert prompt_of(app).text == ""
        loaded.set()
        await wait_for(pilot, lambda: boxes(app) and boxes(app)[-1].text == "Paris.")
        await wait_for(pilot, lambda: not app.chat.generating)
        assert engine.histories and engine.submitted
        assert "question queued" not in str(app.chat.query_one("#status").render())


async def test_queued_question_cancelled_goes_back_to_the_prompt(store):
    engine = FakeEngine()
    app, loaded = slow_loading_app(store, engine)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause(0.05)
        prompt_of(app).text = "never mind"
        await pilot.press("enter")
        await wait_for(pilot, lambda: len(boxes(app)) == 2)
        await pilot.press("escape")
        await wait_for(pilot, lambda: not app.chat.generating)
        assert not boxes(app) and prompt_of(app).text == "never mind"
        loaded.set()
        await wait_for(pilot, lambda: app.engine is not None)
        await pilot.pause(0.05)
        assert engine.submitted == []  # not sent when the model came


async def test_ctrl_c_copies_a_message_selected_with_up(store):
    app = make_app(store, FakeEngine("The answer to copy."))
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.engine is not None)
        prompt_of(app).text = "question"
        await pilot.press("enter")
        await wait_for(pilot, lambda: len(boxes(app)) == 2 and not app.chat.generating)
        await pilot.press("up")
        assert isinstance(app.focused, MessageBox)
        await pilot.press("ctrl+c")
        await pilot.pause(0.05)
        assert app.is_running
        assert app.clipboard == "The answer to copy."
        assert any("Copied 19 characters" in n for n in app.notices)


@pytest.mark.parametrize("select", [False, True])
async def test_second_ctrl_c_within_the_window_always_quits(store, select):
    """Ctrl+C twice quits even mid-answer and with a message selected (the first would
    cancel or copy); the window is widened so a slow machine cannot split the pair."""
    engine = FakeEngine(LONG, delay=0.01)
    app = make_app(store, engine)
    app.double_ctrl_c_s = 60.0
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.engine is not None)
        prompt_of(app).text = "go"
        await pilot.press("enter")
        await wait_for(pilot, lambda: len(boxes(app)) == 2 and boxes(app)[1].text)
        if select:
            await pilot.press("up")
        post_keys(app, "ctrl+c", "ctrl+c")  # the second before the cancel has taken effect
        await until(lambda: not app.is_running)
        del pilot
    assert app.return_code == 0 and engine.stopped


async def test_single_ctrl_c_when_idle_quits_and_mid_answer_cancels(store):
    engine = FakeEngine(LONG, delay=0.01)
    app = make_app(store, engine)
    app.double_ctrl_c_s = 0.0  # each press decided alone
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.engine is not None)
        prompt_of(app).text = "go"
        await pilot.press("enter")
        await wait_for(pilot, lambda: len(boxes(app)) == 2 and boxes(app)[1].text)
        await pilot.press("ctrl+c")
        await wait_for(pilot, lambda: not app.chat.generating)
        assert app.is_running and engine.cancelled == {0}
        await pilot.press("ctrl+c")
        await until(lambda: not app.is_running)
        del pilot
    assert app.return_code == 0


async def test_build_status_shows_elapsed_time(store, monkeypatch):
    monkeypatch.setattr("engine.model.cpu_ext.build.build_pending", lambda: True)
    app, loaded = slow_loading_app(store, FakeEngine())
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: "building" in app.model_status)
        assert re.fullmatch(r"building kvchat's CPU extension \(first run only\): "
                            r"\d+ s so far…", app.model_status)
        assert "~30 s" not in str(app.chat.query_one("#status").render())
        monkeypatch.setattr("engine.model.cpu_ext.build.build_progress", (7, 20))
        await wait_for(pilot, lambda: "7/20 steps" in app.model_status)  # files compiled
        assert re.fullmatch(r"building kvchat's CPU extension \(first run only\): "
                            r"7/20 steps, \d+ s so far…", app.model_status)
        loaded.set()
        await wait_for(pilot, lambda: app.engine is not None)
        assert not app.model_status.startswith("building")



async def test_the_prompt_has_the_focus_from_the_first_frame(store, monkeypatch):
    """Keys typed during start-up arrive as soon as the chat screen is up: the prompt must
    have the focus then (the transcript, the first focusable widget, took it and the keys
    were lost until the prompt's own focus call ran)."""
    from app.tui.screens.chat import ChatScreen

    focused = []
    set_focus = ChatScreen.set_focus

    def recording(self, widget, *args, **kwargs):
        focused.append(widget)
        return set_focus(self, widget, *args, **kwargs)

    monkeypatch.setattr(ChatScreen, "set_focus", recording)
    app = make_app(store)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.engine is not None)
        assert focused and isinstance(focused[0], PromptInput), focused
