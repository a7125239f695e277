"""``/json`` in the chat on the real engine and the embedded default model: the answer
decodes under the engine's json_object constraint, so it parses as a JSON object, or it
was cut by max tokens (then said so, and it is a beginning of one)."""

from __future__ import annotations

import json

import pytest
from test_tui import Borrowed, new_engine, send, stats_of
from test_tui_app import SIZE, boxes, wait_for

from app.conversations import ConversationStore
from app.tui.app import ChatApp

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine(default_model):
    engine = new_engine(default_model)
    yield engine
    engine.shutdown()


@pytest.mark.parametrize("max_tokens", [48, 6])
async def test_json_answers_parse_or_are_cut_by_length(engine, tmp_path, max_tokens):
    store = ConversationStore(tmp_path / "conversations")
    app = ChatApp(engine_factory=lambda spec, kv_cache=None: Borrowed(engine), store=store,
                  remember=False, max_tokens=max_tokens, temperature=0.0)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.engine is not None, 60)
        await send(pilot, app, "/json")
        await wait_for(pilot, lambda: app.chat.json_mode)
        await send(pilot, app, "Give the name and the age of a famous scientist.")
        await wait_for(pilot, lambda: not app.chat.generating, 120)
        answer = boxes(app)[1]
        reason = store.load(store.list()[0].id).messages[1].meta["finish_reason"]
        text = answer.text.strip()
        assert text.startswith("{"), text
        if reason == "stop":
            assert isinstance(json.loads(text), dict)
            assert answer.markdown.source.startswith("```json\n")
        else:
            assert reason == "length" and "max tokens reached" in stats_of(answer)
            with pytest.raises(ValueError):
                json.loads(text)  # a cut object: not shown as parsed JSON
        m = app.engine.metrics()
        assert m.blocks_used == 0 and m.active_sequences == 0
