"""Pilot tests of the chat on the real engine and the embedded default model.

Send and stream, Esc mid-generation (and mid-prefill) with every block back in the
pool, a model switch that shuts the old engine down, a huge paste refused with the
chat kept, and a document whose prefix the next question finds in the KV cache. Each
test builds a small engine on the session's loaded model.
"""

from __future__ import annotations

import re

import pytest
from test_tui_app import SIZE, boxes, wait_for

from app.conversations import ConversationStore
from app.tui.app import ChatApp
from app.tui.screens.dialogs import ConfirmScreen
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
        return ChatApp(engine_factory=lambda spec, kv_cache=None: queue.pop(0), store=store,
                       remember=False, **kwargs)

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
    assert conv.model == "SmolLM2-135M-Instruct"  # its own name, not the spec "default"


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
        # stopped before the first token: the question leaves the chat, back in the prompt
        assert not boxes(app) and app.chat.conversation.messages == []
        assert app.chat.query_one(PromptInput).text.startswith("Summarise this. ")
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
        # F3 on the loaded model keeps it (test_tui_actions.py); a reload (as a new KV
        # format makes) takes the switch path: new engine in, the old one shut down
        app.load_model(None)
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
        assert len(boxes(app)) == 2  # refused: not part of the chat
        assert app.engine.metrics().blocks_used == 0
        await wait_for(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        await pilot.press("escape")  # not as a document either (test_tui_documents.py)
        await wait_for(pilot, lambda: app.screen is app.chat)
        assert app.chat.query_one(PromptInput).text.startswith("lorem ipsum")  # to shorten
        await send(pilot, app, "Still there?")
        await wait_for(pilot, lambda: not app.chat.generating and len(boxes(app)) == 4, 60)
        assert boxes(app)[3].text
    conv = store.load(conv.id)
    assert [m.content for m in conv.messages if m.role == "user"] == ["Hello", "Still there?"]


def station_handbook(sections: int = 16) -> str:
    """~820 tokens of made-up facts, one needle in the middle."""
    paras = [f"Section {i + 1}. Station {i + 1} on the northern line keeps {3 * i + 4} spare "
             f"lamps, opens at {6 + i % 4}:15 and is run by warden number {100 + 7 * i}. "
             f"Its radio call sign is NORTH-{i + 1}." for i in range(sections)]
    paras.insert(sections // 2, "The launch code of the expedition is AZURE-7.")
    return "# Station handbook\n\n" + "\n\n".join(paras)


async def test_document_prefix_is_cached_for_the_next_question(make_app, default_model,
                                                                tmp_path):
    doc = tmp_path / "handbook.md"
    doc.write_text(station_handbook())
    # its own pool, roomy enough for the document whole whatever the other tests cached
    engine = Engine(default_model, EngineConfig(kv_budget_bytes=96 << 20, prefill_chunk=256))
    app = make_app(engine, max_tokens=8)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.engine is not None, 60)
        await send(pilot, app, f"/doc {doc}")
        bar = app.chat.documents
        await wait_for(pilot, lambda: bar.attached is not None, 30)
        assert 600 <= bar.attached.total_tokens <= 1000
        assert str(bar.render()).startswith("doc: handbook.md · ")
        await send(pilot, app, "What is the launch code of the expedition?")
        await wait_for(pilot, lambda: not app.chat.generating and len(boxes(app)) == 2, 120)
        first = stats_of(boxes(app)[1])
        assert "documents placed whole" in first and "nothing left out" in first, first
        assert "prefilled, cached for the next question" in first, first
        await send(pilot, app, "Which warden runs station 3?")
        await wait_for(pilot, lambda: not app.chat.generating and len(boxes(app)) == 4, 120)
        second = stats_of(boxes(app)[3])
        m = re.search(r"prefix ([\d,]+)/([\d,]+) tokens from cache \(memory\)", second)
        assert m is not None, second
        cached, prefix = (int(g.replace(",", "")) for g in m.groups())
        assert 0 < cached <= prefix and prefix - cached < 16  # all but a partial block
        assert "from cache (memory)" in str(bar.render())
        assert app.engine.metrics().blocks_used == 0
