"""SVG snapshots of the chat with the cache panel, on a scripted engine with fixed metrics,
at 120x36, and at 80x24 and 130x40 for the responsive layout.

Nothing in these screens depends on timing: the fake engine's stats and metrics are
constants, and the conversation is saved with fixed content. Update the SVGs with
`pytest tests/test_tui_snapshots.py --snapshot-update` after a deliberate change.
"""

from __future__ import annotations

import pytest
from test_models_hub import add_hub_repo
from test_tui_app import wait_for
from test_tui_fakes import FakeEngine

from app.conversations import ConversationStore
from app.tui.app import ChatApp
from app.tui.screens.conversations import ConversationsScreen
from app.tui.screens.help import HelpScreen
from app.tui.screens.models import ModelsScreen
from app.tui.screens.settings import SettingsScreen
from app.tui.widgets.prompt_input import PromptInput

TERMINAL = (120, 36)
ANSWER = """Paged attention stores the KV cache in **fixed-size blocks**:

1. a block table maps each sequence to its blocks;
2. shared prefixes point at the same blocks (copy-on-write);
3. a cancelled request gives its blocks back at once.

```python
blocks_needed = -(-num_tokens // block_size)
```"""


@pytest.fixture
def saved_chat(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    store = ConversationStore(tmp_path / "conversations")
    conv = store.new(system_prompt="Be brief.")
    conv.add("user", "How does paged attention use the KV cache?")
    conv.add("assistant", ANSWER, finish_reason="stop",
             stats="61 tokens · 18.5 tok/s · TTFT 0.25 s · prefill 480 tok/s · "
                   "16/40 prompt tokens cached")
    store.save(conv)
    return store, conv.id


def make_app(store, conversation_id=None, **kwargs) -> ChatApp:
    return ChatApp(engine_factory=lambda spec, kv_cache=None: FakeEngine(**kwargs), store=store,
                   conversation_id=conversation_id, remember=False)


async def settle(pilot) -> None:
    app = pilot.app
    await wait_for(pilot, lambda: app.engine is not None and not app.model_loading)
    app.chat.query_one(PromptInput).cursor_blink = False
    app.clear_notifications()
    await pilot.pause()


def test_chat_with_cache_panel(snap_compare, saved_chat):
    store, cid = saved_chat
    assert snap_compare(make_app(store, cid), terminal_size=TERMINAL, run_before=settle)


def test_streamed_answer_light_theme(snap_compare, saved_chat):
    store, _ = saved_chat

    async def run_before(pilot):
        await settle(pilot)
        pilot.app.theme = "textual-light"
        pilot.app.chat.query_one(PromptInput).text = "Which city is the capital of France?"
        await pilot.press("enter")
        await wait_for(pilot, lambda: not pilot.app.chat.generating)
        await pilot.pause()

    assert snap_compare(make_app(store), terminal_size=TERMINAL, run_before=run_before)


def test_models_screen(snap_compare, saved_chat, tmp_path):
    store, _ = saved_chat
    add_hub_repo(tmp_path / "hub", "mlx-community/SmolLM2-135M-Instruct-4bit",
                 {"config.json": b'{"model_type": "llama"}', "model.safetensors": b"w" * 4096})

    async def run_before(pilot):
        await settle(pilot)
        await pilot.press("f3")
        await wait_for(pilot, lambda: isinstance(pilot.app.screen, ModelsScreen))
        await pilot.pause()

    assert snap_compare(make_app(store), terminal_size=TERMINAL, run_before=run_before)


def test_cache_panel_quantized(snap_compare, saved_chat):
    """The panel of an engine built in q8: its format, share of fp16 and bytes saved."""
    store, cid = saved_chat
    assert snap_compare(make_app(store, cid, kv_cache="q8"), terminal_size=TERMINAL,
                        run_before=settle)


def test_settings_screen(snap_compare, saved_chat):
    store, _ = saved_chat

    async def run_before(pilot):
        await settle(pilot)
        await pilot.press("f6")
        await wait_for(pilot, lambda: isinstance(pilot.app.screen, SettingsScreen))
        await pilot.pause()

    assert snap_compare(make_app(store), terminal_size=TERMINAL, run_before=run_before)


def test_document_attached(snap_compare, saved_chat, tmp_path):
    """The document bar over the prompt, and the document line under an answer."""
    store, _ = saved_chat
    doc = tmp_path / "handbook.md"
    doc.write_text("# Handbook\n\nThe launch code is AZURE-7. The backup site is in Tromsø.\n")

    async def run_before(pilot):
        await settle(pilot)
        prompt = pilot.app.chat.query_one(PromptInput)
        prompt.text = f"/doc {doc}"
        await pilot.press("enter")
        await wait_for(pilot, lambda: pilot.app.chat.documents.attached is not None)
        prompt.text = "What is the launch code?"
        await pilot.press("enter")
        await wait_for(pilot, lambda: not pilot.app.chat.generating)
        pilot.app.clear_notifications()
        await pilot.pause()

    assert snap_compare(make_app(store, reply="The launch code is **AZURE-7**."),
                        terminal_size=TERMINAL, run_before=run_before)


NARROW, MEDIUM = (80, 24), (130, 40)


def test_narrow_chat_collapses_the_cache_panel(snap_compare, saved_chat):
    """80x24: the panel is one line under the prompt, and the footer fits."""
    store, cid = saved_chat
    assert snap_compare(make_app(store, cid), terminal_size=NARROW, run_before=settle)


def test_narrow_chat_with_the_panel_expanded(snap_compare, saved_chat):
    store, cid = saved_chat

    async def run_before(pilot):
        await settle(pilot)
        await pilot.press("f2")
        await pilot.pause()

    assert snap_compare(make_app(store, cid), terminal_size=NARROW, run_before=run_before)


def test_a_selected_answer_and_its_keys(snap_compare, saved_chat):
    """130x40: the answer selected (↑ from the prompt); the footer shows what it can do."""
    store, cid = saved_chat

    async def run_before(pilot):
        await settle(pilot)
        await pilot.press("up")
        await pilot.pause()

    assert snap_compare(make_app(store, cid), terminal_size=MEDIUM, run_before=run_before)


def test_conversations_with_wide_titles(snap_compare, tmp_path, monkeypatch):
    """F4 at 80x24: CJK and emoji titles keep the columns in place."""
    import time

    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    store = ConversationStore(tmp_path / "conversations")
    for i, q in enumerate(["東京の天気について教えてください。明日は雨ですか？それとも晴れ？",
                           "Rust lifetimes 🙂🙂🙂 explained, with examples please",
                           "How does paged attention use the KV cache?"]):
        conv = store.new(model="default")
        conv.add("user", q)
        conv.add("assistant", "ok")
        conv.updated = 1_780_000_000 + 3600 * i
        store.save(conv)

    async def run_before(pilot):
        await settle(pilot)
        await pilot.press("f4")
        await wait_for(pilot, lambda: isinstance(pilot.app.screen, ConversationsScreen))
        await pilot.pause()

    assert snap_compare(make_app(store), terminal_size=NARROW, run_before=run_before)
    monkeypatch.undo()
    time.tzset()


def test_help_screen(snap_compare, saved_chat):
    store, _ = saved_chat

    async def run_before(pilot):
        await settle(pilot)
        await pilot.press("f1")
        await wait_for(pilot, lambda: isinstance(pilot.app.screen, HelpScreen))
        await pilot.pause()

    assert snap_compare(make_app(store), terminal_size=MEDIUM, run_before=run_before)


def test_an_answer_with_folded_reasoning_and_a_tool_call(snap_compare, tmp_path, monkeypatch):
    """130x40: the reasoning and the tool call as one folded line each around the text."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    store = ConversationStore(tmp_path / "conversations")
    conv = store.new()
    conv.add("user", "What's the weather in Paris?")
    conv.add("assistant", "Let me look that up.", finish_reason="stop",
             stats="48 tokens · 18.5 tok/s · TTFT 0.25 s · prefill 480 tok/s · "
                   "16/40 prompt tokens cached",
             reasoning="The user wants the weather. I should call get_weather for Paris.",
             reasoning_tokens=14,
             tool_calls=[{"name": "get_weather", "arguments": '{"city": "Paris"}'}])
    store.save(conv)
    assert snap_compare(make_app(store, conv.id), terminal_size=MEDIUM, run_before=settle)
