"""The chat's summarize policy through the real TUI on the scripted engine: a summary
written at background priority after an answer, shown, saved beside the turns, and sent
with the next question instead of the turns it covers."""

from __future__ import annotations

import pytest
from test_tui_app import ask, make_app, wait_for
from test_tui_fakes import FakeEngine

from app.conversations import ConversationStore
from engine.request import Priority


@pytest.fixture
def store(tmp_path):
    return ConversationStore(tmp_path / "conversations")


async def test_a_long_chat_is_summarized_shown_saved_and_sent(store):
    engine = FakeEngine(" ".join(["the user's code is 4817"] * 4))
    app = make_app(store, engine, context_budget=300)
    async with app.run_test() as pilot:
        await wait_for(pilot, lambda: app.engine is not None)
        for i in range(7):
            await ask(pilot, app, f"question {i} " + "word " * 12)
        await wait_for(pilot, lambda: app.chat.conversation.summary is not None
                       and app.chat.summary_running is None)  # none still being written
        assert Priority.BACKGROUND in [k["priority"] for k in engine.submit_kwargs]
        markers = list(app.chat.query(".summary-marker"))
        assert markers and "summarized" in str(markers[-1].title)
        saved = store.load(app.chat.conversation.id)
        assert saved.summary["text"] and len(saved.messages) == 14  # the turns stay too
        covered = saved.summary["messages"]
        before = len(engine.histories)
        await ask(pilot, app, "what was my code?")
        sent = engine.histories[before]  # the question's (a summary's requests may follow)
        assert sent == app.chat.conversation.history()[covered:-2]
