"""Pilot tests of the message actions (copy, retry, edit, delete), honest cancels, Ctrl+C,
a clean quit, the help screen and the palette, on the scripted engine."""

from __future__ import annotations

import threading

from test_tui_app import SIZE, ask, boxes, make_app, start_answer, store, wait_for
from test_tui_fakes import FakeEngine, long_reply

from app.tui.app import ChatApp
from app.tui.screens.help import HelpScreen, help_sections
from app.tui.screens.models import ModelsScreen
from app.tui.widgets.prompt_input import PromptInput
from app.tui.widgets.transcript import MessageBox

__all__ = ["store"]  # the fixture, shared with test_tui_app


async def two_turns(pilot, app) -> None:
    await wait_for(pilot, lambda: app.engine is not None)
    await ask(pilot, app, "first question")
    await ask(pilot, app, "second question")
    await pilot.pause()


def history(app) -> list[str]:
    return [m.content for m in app.chat.conversation.messages]


async def test_up_selects_messages_and_c_copies(store):
    app = make_app(store, FakeEngine("an answer"))
    async with app.run_test(size=SIZE) as pilot:
        await two_turns(pilot, app)
        await pilot.press("up")  # from the prompt's first line: the newest message
        assert app.focused is boxes(app)[3]
        await pilot.press("up", "up")
        assert app.focused is boxes(app)[1]
        await pilot.press("c")
        assert app.clipboard == "an answer"
        await pilot.press("k", "y")
        assert app.clipboard == "first question"
        await pilot.press("down", "down", "down", "down")  # past the last: the prompt
        assert isinstance(app.focused, PromptInput)
        await pilot.press("down")  # stays
        assert isinstance(app.focused, PromptInput)
        await pilot.click(boxes(app)[2])
        assert app.focused is boxes(app)[2]
        await pilot.press("escape")
        assert isinstance(app.focused, PromptInput)


async def test_retry_writes_the_last_answer_again(store):
    app = make_app(store)
    async with app.run_test(size=SIZE) as pilot:
        await two_turns(pilot, app)
        engine = app.engine
        await pilot.press("up", "r")
        await wait_for(pilot, lambda: not app.chat.generating and len(boxes(app)) == 4)
        assert history(app)[2:] == ["second question", "The capital of France is **Paris**."]
        # the retry was sent with the first turn only as its history
        assert engine.histories[-1] == [
            {"role": "user", "content": "first question"},
            {"role": "assistant", "content": "The capital of France is **Paris**."}]
        assert isinstance(app.focused, PromptInput)  # ready for the next question
        boxes(app)[1].focus()
        await pilot.press("r")  # an earlier answer: refused, nothing lost
        assert len(history(app)) == 4 and any("Only the last answer" in n for n in app.notices)
        cid = app.chat.conversation.id
    assert len(store.load(cid).messages) == 4


async def test_edit_resends_and_drops_the_later_turns(store):
    app = make_app(store)
    async with app.run_test(size=SIZE) as pilot:
        await two_turns(pilot, app)
        await pilot.press("up", "up", "up", "up")
        assert app.focused is boxes(app)[0]
        await pilot.press("e")
        prompt = app.chat.query_one(PromptInput)
        assert app.focused is prompt and prompt.text == "first question"
        assert "editing" in str(app.chat.query_one("#status").render())
        await pilot.press(*" again", "enter")
        await wait_for(pilot, lambda: not app.chat.generating and len(boxes(app)) == 2)
        assert history(app)[0] == "first question again" and len(history(app)) == 2
        assert app.engine.histories[-1] == []  # nothing before it any more
        # Esc ends an edit without changing the chat
        await pilot.press("up", "up", "e", "escape")
        assert prompt.text == "" and len(history(app)) == 2 and app.chat.editing is None
        cid = app.chat.conversation.id
    assert len(store.load(cid).messages) == 2


async def test_delete_a_turn(store):
    app = make_app(store)
    async with app.run_test(size=SIZE) as pilot:
        await two_turns(pilot, app)
        await pilot.press("up", "up", "up")  # the first answer
        await pilot.press("d")
        await wait_for(pilot, lambda: len(boxes(app)) == 2)
        assert history(app) == ["second question", "The capital of France is **Paris**."]
        assert app.focused is boxes(app)[0]
        await pilot.press("delete")
        await wait_for(pilot, lambda: not boxes(app))
    assert store.list() == []  # an emptied chat is not kept


async def test_a_cancelled_partial_answer_is_marked_and_deleted_with_one_key(store):
    engine = FakeEngine(long_reply(400), delay=0.01)
    app = make_app(store, engine)
    async with app.run_test(size=SIZE) as pilot:
        await start_answer(pilot, app)
        await pilot.press("escape")
        await wait_for(pilot, lambda: not app.chat.generating)
        answer = boxes(app)[1]
        assert answer.has_class("-cancelled")
        assert app.chat.conversation.messages[1].meta["finish_reason"] == "cancelled"
        await pilot.press("up", "d")
        await wait_for(pilot, lambda: not boxes(app))
        engine.delay = 0
        await ask(pilot, app, "hi")
        assert engine.histories[-1] == []  # the cancelled turn is not re-read


async def test_a_prompt_cancelled_before_any_answer_leaves_the_chat(store):
    engine = FakeEngine("a b c", prefill_events=200)
    gate = threading.Event()
    original = engine._events

    def slow_events(rid, n, params):
        gate.wait(10)  # the "prefill" holds until the test has pressed Esc
        yield from original(rid, n, params)

    engine._events = slow_events
    app = make_app(store, engine)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.engine is not None)
        app.chat.query_one(PromptInput).text = "a long document"
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.chat.turn is not None
                       and app.chat.turn.request_id is not None)
        await pilot.press("escape")
        gate.set()
        await wait_for(pilot, lambda: not app.chat.generating)
        assert not boxes(app) and app.chat.conversation.messages == []
        assert app.chat.query_one(PromptInput).text == "a long document"
        assert any("not kept in the chat" in n for n in app.notices)
    assert store.list() == []


async def test_ctrl_c_copies_a_selection_instead_of_quitting(store):
    app = make_app(store)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.engine is not None)
        prompt = app.chat.query_one(PromptInput)
        prompt.text = "copy me"
        prompt.select_all()
        await pilot.press("ctrl+c")
        assert app.clipboard == "copy me" and app.is_running
        prompt.move_cursor((0, 0))
        await pilot.press("ctrl+c")
        await wait_for(pilot, lambda: not app.is_running)


async def test_quit_while_a_model_loads_waits_and_shuts_it_down(store):
    release = threading.Event()
    built = []

    def factory(spec, kv_cache=None):
        release.wait(10)  # a load that takes a while
        built.append(FakeEngine())
        return built[-1]

    app = ChatApp(engine_factory=factory, store=store, remember=False)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        assert app.model_loading
        await pilot.press("ctrl+q")
        await pilot.pause(0.1)
        assert app.is_running  # waiting for the load
        release.set()
        await wait_for(pilot, lambda: not app.is_running)
    assert built and built[0].started and built[0].stopped and app.engine is None


async def test_quit_mid_answer_stops_the_engine_first(store):
    engine = FakeEngine(long_reply(400), delay=0.01)
    app = make_app(store, engine)
    async with app.run_test(size=SIZE) as pilot:
        await start_answer(pilot, app)
        await pilot.press("ctrl+q")
        await wait_for(pilot, lambda: not app.is_running)
    assert engine.stopped
    assert not [w for w in app.workers if w.group == "generation" and not w.is_finished]


async def test_help_lists_every_key(store):
    app = make_app(store)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.engine is not None)
        await pilot.press("f1")
        await wait_for(pilot, lambda: isinstance(app.screen, HelpScreen))
        sections = help_sections(app.BINDINGS)
        described = {d for rows in sections.values() for _, d in rows}
        for b in [*ChatApp.BINDINGS, *MessageBox.BINDINGS]:
            assert (b.tooltip or b.description) in described, b
        assert ("F1 / ?", "Help") in sections["Chat"]
        await pilot.press("escape")
        await wait_for(pilot, lambda: app.screen is app.chat)


async def test_palette_has_no_duplicates(store):
    app = make_app(store)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.engine is not None)
        titles = [c.title for c in app.get_system_commands(app.screen)]
        assert "Quit" not in titles and "Keys" not in titles


async def test_choosing_the_loaded_model_does_not_reload_it(store):
    app = make_app(store)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.engine is not None)
        first = app.engine
        await pilot.press("f3")
        await wait_for(pilot, lambda: isinstance(app.screen, ModelsScreen))
        await pilot.press("enter")  # the first row: the embedded default, loaded
        await wait_for(pilot, lambda: app.screen is app.chat)
        await pilot.pause(0.1)
        assert app.engine is first and len(app.engines) == 1
        assert any("already loaded" in n for n in app.notices)


async def test_narrow_terminals_collapse_the_cache_panel(store):
    from app.tui.widgets.cache_panel import CachePanel, CacheSummary

    app = make_app(store)
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_for(pilot, lambda: app.engine is not None)
        panel, summary = app.chat.query_one(CachePanel), app.chat.query_one(CacheSummary)
        assert not panel.display and summary.display
        await pilot.pause(0.3)
        assert "6 used" in str(summary.render()) and "8.4 MiB held" in str(summary.render())
        await pilot.press("f2")
        assert panel.display and not summary.display
        await pilot.resize_terminal(130, 40)
        await pilot.pause()
        assert panel.display  # wide: the panel, whatever F2 said when narrow
        await pilot.press("f2")
        assert not panel.display and summary.display


async def test_last_turn_resets_during_an_answer_and_on_a_new_engine(store):
    from app.tui.widgets.cache_panel import CachePanel

    app = make_app(store, FakeEngine(long_reply(400), delay=0.01))
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.engine is not None)
        panel = app.chat.query_one(CachePanel)
        await ask(pilot, app, "hi")
        assert panel.last_turn is not None
        app.chat.query_one(PromptInput).text = "again"
        await pilot.press("enter")
        assert panel.last_turn is None  # not the previous turn's line while this one runs
        await pilot.press("escape")
        await wait_for(pilot, lambda: not app.chat.generating)
        assert panel.last_turn is not None
        app.load_model("other")
        await wait_for(pilot, lambda: len(app.engines) == 2 and not app.model_loading)
        assert panel.last_turn is None
