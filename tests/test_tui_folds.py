"""The chat's folded answer parts (issue 29 part 6) on a scripted engine: reasoning
streamed into a "Thinking…" fold that ends as "Thought for N tokens", tool calls as
"called f({...})" lines, Enter and clicks to open them, saved chats and exports keeping
them, and ``/json`` asking the engine for a JSON object (the real model: test_tui_json.py).
"""

from __future__ import annotations

import json
import threading
import time

import pytest
from test_tui_app import SIZE, ask, boxes, make_app, wait_for
from test_tui_fakes import FakeEngine, FakeHandle, fixed_stats
from textual.widgets.collapsible import CollapsibleTitle

from app.conversations import ConversationStore
from app.tool_calls import parse_calls
from app.tui.answer import AnswerStream, split_answer
from app.tui.app import ChatApp
from app.tui.export import markdown
from app.tui.generation import FLUSH_S
from app.tui.widgets.folds import ReasoningFold, ToolCallFold
from app.tui.widgets.prompt_input import PromptInput
from engine.generation import GenerationEvent

REASONING = "The user asks 2+2. Adding: 2 and 2 make 4."
ANSWER_TEXT = "2 + 2 = **4**."
THINKING_REPLY = f"<think>\n{REASONING}\n</think>\n\n{ANSWER_TEXT}"
CALL_ARGS = {"city": "Paris", "unit": "celsius"}
CALL_REPLY = ('Let me look that up.\n<tool_call>\n'
              + json.dumps({"name": "get_weather", "arguments": CALL_ARGS}) + "\n</tool_call>")


@pytest.fixture
def store(tmp_path):
    return ConversationStore(tmp_path / "conversations")


def chunked(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


class ChunkEngine(FakeEngine):
    """Streams given chunks of text (cut anywhere, tags too); records each request's
    params; after ``hold_at`` chunks it waits for ``gate``. Chunks before it come a flush
    interval apart, so the chat has each of them before the wait."""

    def __init__(self, chunks: list[str], *, hold_at: int | None = None):
        super().__init__()
        self.chunks, self.hold_at = chunks, hold_at
        self.gate = threading.Event()
        self.params: list = []
        self.systems: list[str | None] = []

    def encode_prompt(self, prompt, *, system=None, raw=False, history=None):
        self.systems.append(system)
        return super().encode_prompt(prompt, system=system, raw=raw, history=history)

    def submit(self, prompt_ids, params=None, **kwargs):
        handle = super().submit(prompt_ids, params, **kwargs)
        self.params.append(params)
        return FakeHandle(handle.request_id, self._chunks(handle.request_id, len(prompt_ids)),
                          self, handle.max_tokens)

    def _chunks(self, rid, n):
        for i, chunk in enumerate(self.chunks):
            if self.hold_at is not None and i <= self.hold_at:
                time.sleep(FLUSH_S * 1.5)
            if i == self.hold_at:
                self.gate.wait(30)
            if rid in self.cancelled or self.stopped:
                yield GenerationEvent(rid, None, "", finish_reason="cancelled",
                                      stats=fixed_stats(n, i))
                return
            yield GenerationEvent(rid, i, chunk)
        yield GenerationEvent(rid, None, "", finish_reason="stop",
                              stats=fixed_stats(n, len(self.chunks)))


# -- splitting -------------------------------------------------------------------------

@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, 1000])
def test_reasoning_cut_anywhere_across_chunks_routes_the_same(size):
    stream, reasoning, shown = AnswerStream(), "", ""
    for chunk in chunked(THINKING_REPLY, size):
        r, c = stream.feed(chunk)
        reasoning, shown = reasoning + r, shown + c
    assert "<" not in reasoning and "think>" not in shown  # no piece of a tag leaks
    assert reasoning.strip() == REASONING and shown.strip() == ANSWER_TEXT
    parts = split_answer(THINKING_REPLY)
    assert (parts.reasoning, parts.content, parts.calls) == (REASONING, ANSWER_TEXT, [])


def test_reasoning_opened_by_the_template_is_split_at_the_end():
    """A template that opens <think> itself: the answer has only the closing tag."""
    parts = split_answer(f"{REASONING}\n</think>\n\n{ANSWER_TEXT}")
    assert (parts.reasoning, parts.content) == (REASONING, ANSWER_TEXT)
    assert split_answer(ANSWER_TEXT).reasoning == ""


@pytest.mark.parametrize("size", [1, 4, 1000])
def test_a_tool_call_is_held_back_while_streaming(size):
    stream, shown = AnswerStream(), ""
    for chunk in chunked(CALL_REPLY, size):
        shown += stream.feed(chunk)[1]
    assert shown.strip() == "Let me look that up."  # the call never shows as text
    parts = split_answer(CALL_REPLY)
    assert parts.content == "Let me look that up."
    [call] = parts.calls
    assert call.name == "get_weather" and json.loads(call.arguments) == CALL_ARGS


def test_calls_of_every_family_without_tools_offered():
    mistral = '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}]'
    llama = '{"name": "add", "parameters": {"a": 1, "b": 2}}'
    for text in (mistral, llama):
        content, [call] = parse_calls(text)
        assert content == "" and call.name == "add"
        assert json.loads(call.arguments) == {"a": 1, "b": 2}
    # a JSON answer is not a call: other keys, or asked for with /json
    assert parse_calls('{"name": "Ada", "age": 36}') == ('{"name": "Ada", "age": 36}', [])
    assert split_answer(llama, json_answer=True).calls == []
    # broken call JSON stays text
    assert parse_calls("<tool_call>{not json</tool_call>")[1] == []


# -- the chat --------------------------------------------------------------------------

def reasoning_fold(box) -> ReasoningFold:
    return box.query_one(ReasoningFold)


def title_of(fold) -> str:
    return str(fold.title)


async def test_reasoning_streams_into_a_fold_that_ends_folded(store):
    chunks = chunked(THINKING_REPLY, 3)
    engine = ChunkEngine(chunks, hold_at=len(chunks) // 3)  # held while still thinking
    app = make_app(store, engine)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.engine is not None)
        app.chat.query_one(PromptInput).text = "What is 2+2?"
        await pilot.press("enter")
        await wait_for(pilot, lambda: len(boxes(app)) == 2
                       and reasoning_fold(boxes(app)[1]).text.strip())
        answer = boxes(app)[1]
        fold = reasoning_fold(answer)
        assert fold.display and fold.collapsed and title_of(fold) == "Thinking…"
        assert answer.text == ""  # nothing of the reasoning in the answer's text
        fold.collapsed = False  # opened while it streams: the rest arrives in it
        so_far = fold.text
        engine.gate.set()
        await wait_for(pilot, lambda: not app.chat.generating)
        await pilot.pause()
        assert len(fold.text) > len(so_far) and fold.text.startswith(so_far)
        assert str(fold.body.render()).strip() == REASONING
        tokens = engine.count_tokens(REASONING)
        assert title_of(fold) == f"Thought for {tokens:,} tokens"
        assert answer.text == ANSWER_TEXT
        assert "think" not in answer.markdown.source
    conv = store.load(store.list()[0].id)
    assert conv.messages[1].content == ANSWER_TEXT
    assert conv.messages[1].meta["reasoning"] == REASONING
    assert conv.messages[1].meta["reasoning_tokens"] == tokens
    assert engine.histories == [[]]  # the question went alone


async def test_enter_and_click_unfold_and_a_reopened_chat_keeps_the_fold(store):
    app = make_app(store, ChunkEngine(chunked(THINKING_REPLY, 4)))
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.engine is not None)
        await ask(pilot, app, "What is 2+2?")
        answer = boxes(app)[1]
        fold = reasoning_fold(answer)
        assert fold.collapsed
        await pilot.press("up")
        await wait_for(pilot, lambda: app.focused is answer)
        await pilot.press("enter")
        await wait_for(pilot, lambda: not fold.collapsed)
        await pilot.press("enter")
        await wait_for(pilot, lambda: fold.collapsed)
        await pilot.click(fold.query_one(CollapsibleTitle))
        await wait_for(pilot, lambda: not fold.collapsed)
        cid = app.chat.conversation.id
    again = ChatApp(engine_factory=lambda spec, kv_cache=None: FakeEngine(), store=store,
                    conversation_id=cid, remember=False)
    async with again.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: len(boxes(again)) == 2)
        await pilot.pause()
        fold = reasoning_fold(boxes(again)[1])
        assert fold.display and fold.collapsed
        assert title_of(fold) == f"Thought for {FakeEngine().count_tokens(REASONING):,} tokens"
        assert boxes(again)[1].text == ANSWER_TEXT


async def test_tool_calls_show_folded_saved_and_exported(store):
    app = make_app(store, ChunkEngine(chunked(CALL_REPLY, 5)))
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.engine is not None)
        await ask(pilot, app, "Weather in Paris?")
        await pilot.pause()
        answer = boxes(app)[1]
        [fold] = answer.query(ToolCallFold)
        assert fold.display and fold.collapsed
        assert title_of(fold) == f"called get_weather({json.dumps(CALL_ARGS)})"
        assert "tool_call" not in answer.markdown.source
        assert answer.text == "Let me look that up."
        assert not reasoning_fold(answer).display
        await pilot.click(fold.query_one(CollapsibleTitle))
        await wait_for(pilot, lambda: not fold.collapsed)
        assert json.loads(str(fold.body.render())) == CALL_ARGS
        copied = []
        app.copy_to_clipboard = copied.append
        answer.focus()  # (the click left the focus on the fold's title)
        await wait_for(pilot, lambda: app.focused is answer)
        await pilot.press("c")
        await wait_for(pilot, lambda: copied)
        text, call = copied[0].split("\n\n")  # the text, then the call written out whole
        assert text == answer.text and call.startswith("called get_weather({")
        assert json.loads(call.removeprefix("called get_weather(")[:-1]) == CALL_ARGS
    conv = store.load(store.list()[0].id)
    [saved] = conv.messages[1].meta["tool_calls"]
    assert saved["name"] == "get_weather" and json.loads(saved["arguments"]) == CALL_ARGS
    text = markdown(conv)
    assert "**Called `get_weather`:**" in text and '"city": "Paris"' in text
    assert "<tool_call>" not in text


async def test_export_keeps_the_reasoning_in_a_details_block(store):
    conv = store.new()
    conv.add("user", "What is 2+2?")
    conv.add("assistant", ANSWER_TEXT, finish_reason="stop", reasoning=REASONING,
             reasoning_tokens=14)
    text = markdown(conv)
    head, _, rest = text.partition("<details><summary>Thought for 14 tokens</summary>")
    assert "## Assistant" in head
    reasoning, _, after = rest.partition("</details>")
    assert reasoning.strip() == "> " + REASONING
    assert after.strip() == ANSWER_TEXT


async def test_json_command_constrains_the_next_questions(store):
    engine = ChunkEngine(['{"answer"', ': 4}'])
    app = make_app(store, engine)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.engine is not None)
        status = app.chat.query_one("#status")
        prompt = app.chat.query_one(PromptInput)
        prompt.text = "/json"
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.chat.json_mode)
        assert prompt.text == ""
        await wait_for(pilot, lambda: "JSON" in str(status.render()))
        for question in ("What is 2+2?", "And 3+3?"):
            await ask(pilot, app, question)
        assert [p.constraint.kind for p in engine.params] == ["json_object"] * 2
        assert all("JSON" in system for system in engine.systems)  # asked for in words too
        answer = boxes(app)[-1]
        assert answer.text == '{"answer": 4}'  # saved and copied as written
        assert answer.markdown.source.startswith("```json\n")  # shown indented
        prompt.text = "/json off"
        await pilot.press("enter")
        await wait_for(pilot, lambda: not app.chat.json_mode)
        await wait_for(pilot, lambda: "JSON" not in str(status.render()))
        prompt.text = "Plain now?"
        await pilot.press("enter")
        await wait_for(pilot, lambda: not app.chat.generating)
        assert engine.params[-1].constraint is None and engine.systems[-1] is None
        prompt.text = "/json maybe"
        await pilot.press("enter")
        await pilot.pause()
        assert not app.chat.json_mode and prompt.text == "/json maybe"
        await app.run_action("toggle_json")  # the palette's "JSON answers on/off"
        assert app.chat.json_mode
    conv = store.load(store.list()[0].id)
    assert [m.meta.get("json", False) for m in conv.messages[1::2]] == [True, True, False]
