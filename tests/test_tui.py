"""Pilot tests of the chat on the real engine and the embedded default model.

Send and stream, Esc mid-generation (and mid-prefill) with every block back in the
pool, a model switch that shuts the old engine down, and a huge paste refused with
the chat kept. Each test builds a small engine on the session's loaded model.
"""

from __future__ import annotations

import pytest
from test_tui_app import SIZE, boxes, wait_for

from app.conversations import ConversationStore
from app.tui.app import ChatApp
from app.tui.screens.models import ModelsScreen
from app.tui.widgets.prompt_input import PromptInput
from engine import Engine, EngineConfig, SamplingParams
from engine.errors import EngineStoppedError

pytestmark = pytest.mark.slow


@pytest.fixture
def store(tmp_path):
    return ConversationStore(tmp_path / "conversations")


class Borrowed:
    """The module's engine lent to one app: the app's shutdown leaves it running."""

    def __init__(self, engine: Engine):
        self._engine = engine

    def shutdown(self) -> None:
        pass

    def __getattr__(self, name):
        return getattr(self._engine, name)


def new_engine(model, **config) -> Engine:
    # Built on the main thread: MLX arrays belong to the thread whose stream made them,
    # and every engine here shares the session's model.
    return Engine(model, EngineConfig(kv_budget_bytes=48 << 20, prefill_chunk=64, **config))


@pytest.fixture(scope="module")
def shared_engine(default_model):
    engine = new_engine(default_model)
    yield engine
    engine.shutdown()


@pytest.fixture
def make_app(shared_engine, store):
    def build(*engines, **kwargs) -> ChatApp:
        queue = list(engines) or [Borrowed(shared_engine)]
        return ChatApp(engine_factory=lambda spec: queue.pop(0), store=store, remember=False,
                       **kwargs)

    return build


def stats_of(box) -> str:
    return str(box.query_one(".stats").render())


async def send(pilot, app, text: str) -> None:
    app.chat.query_one(PromptInput).text = text
    await pilot.press("enter")


async def test_send_streams_the_answer(make_app, store):
    app = make_app(max_tokens=8)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.engine is not None, 60)
        await send(pilot, app, "What is the capital of France?")
        await wait_for(pilot, lambda: not app.chat.generating, 60)
        user, answer = boxes(app)
        assert answer.text.startswith("The capital of France is")
        assert "8 tokens" in stats_of(answer) and "tok/s" in stats_of(answer)
        m = app.engine.metrics()
        assert m.blocks_used == 0 and m.active_sequences == 0
    conv = store.load(store.list()[0].id)
    assert conv.messages[1].content == answer.text
    assert conv.model == "default"


async def test_escape_mid_generation_gives_every_block_back(make_app, store):
    app = make_app(max_tokens=400)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.engine is not None, 60)
        await send(pilot, app, "Write a long story about a dragon who learns to bake bread.")
        await wait_for(pilot, lambda: len(boxes(app)) == 2 and len(boxes(app)[1].text) > 10, 60)
        assert app.engine.metrics().blocks_used > 0
        await pilot.press("escape")
        await wait_for(pilot, lambda: not app.chat.generating, 10)
        stats = stats_of(boxes(app)[1])
        released = int(stats.removeprefix("cancelled — ").split()[0])
        assert released > 0, stats
        m = app.engine.metrics()
        assert m.blocks_used == 0 and m.active_sequences == 0
        assert not set(app.engine.block_map()) & {"#", "S"}
    conv = store.load(store.list()[0].id)
    assert conv.messages[1].meta["finish_reason"] == "cancelled"


async def test_escape_during_a_long_prefill(make_app):
    app = make_app(max_tokens=8)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.engine is not None, 60)
        await send(pilot, app, "Summarise this. " + "The quick brown fox jumps. " * 120)
        bar = app.chat.query_one("#prefill")
        await wait_for(pilot, lambda: bar.display, 30)
        await pilot.press("escape")
        await wait_for(pilot, lambda: not app.chat.generating, 10)
        answer = boxes(app)[1]
        assert answer.text == ""  # stopped before the first token
        assert stats_of(answer).startswith("cancelled — ")
        assert int(stats_of(answer).split()[2]) > 0
        assert app.engine.metrics().blocks_used == 0
        assert not bar.display


async def test_switch_model_mid_answer_shuts_the_old_engine_down(make_app, default_model,
                                                                 shared_engine):
    app = make_app(new_engine(default_model), Borrowed(shared_engine), max_tokens=400)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.engine is not None, 60)
        old = app.engine
        await send(pilot, app, "Tell me everything about the history of bread.")
        await wait_for(pilot, lambda: len(boxes(app)) == 2 and boxes(app)[1].text, 60)
        await pilot.press("f3")
        await wait_for(pilot, lambda: isinstance(app.screen, ModelsScreen))
        await pilot.press("enter")  # the first row: the embedded default
        await wait_for(pilot, lambda: app.engine is not old and not app.chat.generating, 60)
        assert "the model was unloaded" in stats_of(boxes(app)[1])
        assert old.metrics().blocks_used == 0
        with pytest.raises(EngineStoppedError):
            old.submit([1, 2, 3], SamplingParams(max_tokens=1))
        app.max_tokens = 2
        await send(pilot, app, "Hi")
        await wait_for(pilot, lambda: not app.chat.generating and len(boxes(app)) == 4, 60)
        assert boxes(app)[3].text


async def test_huge_paste_is_refused_and_the_chat_kept(make_app, store):
    conv = store.new()
    conv.add("user", "Hello")
    conv.add("assistant", "Hi! How can I help?")
    store.save(conv)
    app = make_app(max_tokens=2, conversation_id=conv.id)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.engine is not None and len(boxes(app)) == 2, 60)
        await send(pilot, app, "lorem ipsum " * 17000)  # ~200k characters, ~85k tokens
        await wait_for(pilot, lambda: not app.chat.generating, 60)
        await pilot.pause()
        huge = boxes(app)[2]
        assert "not sent:" in stats_of(huge) and "tokens" in stats_of(huge)
        assert app.engine.metrics().blocks_used == 0
        await send(pilot, app, "Still there?")
        await wait_for(pilot, lambda: not app.chat.generating and len(boxes(app)) == 5, 60)
        assert boxes(app)[4].text
    conv = store.load(conv.id)
    assert [m.content for m in conv.messages if m.role == "user"] == ["Hello", "Still there?"]
