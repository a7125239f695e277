"""An answer's parts as the chat shows them: reasoning, text, tool calls, JSON.

The model's raw text is split here, nothing drawn: ``<think>…</think>`` reasoning
(`app.reasoning`), the tool calls it wrote (`app.tool_calls`; the chat offers no tools, so
they are only shown), and the text in between. `AnswerStream` routes streamed text as it
comes, holding back what may be a tag or a call; `split_answer` is the final word on the
whole text. Saved chats keep the parts in the message's meta (`parts_meta`).
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field

from app.reasoning import CLOSE, ReasoningStream, partial_tail, split
from app.tool_calls import MARKERS, ToolCall, parse_calls

CALL_ARGS_CHARS = 60  # a folded call's title shows this much of its arguments


@dataclass(slots=True)
class AnswerParts:
    content: str  # the answer's text, without reasoning or calls
    reasoning: str = ""
    calls: list[ToolCall] = field(default_factory=list)


def split_answer(raw: str, *, json_answer: bool = False) -> AnswerParts:
    """The parts of a whole answer; a JSON answer (``/json``) is never taken for a call."""
    reasoning, rest = split(raw)
    if reasoning is None and CLOSE in raw:  # the template opened the tag: no <think> seen
        reasoning, rest = split(raw, inside=True)
    content, calls = parse_calls(rest, None, bare_json=not json_answer)
    return AnswerParts(content, reasoning or "", calls)


class AnswerStream:
    """Routes streamed text: `feed` returns (reasoning, text) that can be shown now.

    Text from a tool-call marker on is held (the end shows it as calls); a bare JSON call
    is known only at the end, so it streams as text until then.
    """

    def __init__(self):
        self.think = ReasoningStream()
        self.held = ""
        self.calling = False  # a marker came: the rest is held

    def feed(self, text: str) -> tuple[str, str]:
        reasoning, content = self.think.feed(text)
        if self.calling or not content:
            self.held += content
            return reasoning, ""
        self.held += content
        starts = [i for i in (self.held.find(m) for m in MARKERS) if i >= 0]
        if starts:
            self.calling = True
            shown, self.held = self.held[:min(starts)], self.held[min(starts):]
            return reasoning, shown
        keep = max(partial_tail(self.held, m) for m in MARKERS)
        shown, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
        return reasoning, shown


def parts_meta(parts: AnswerParts, *, reasoning_tokens: int | None = None,
               json_answer: bool = False) -> dict:
    """What a saved message keeps of the parts besides its text."""
    meta: dict = {}
    if parts.reasoning:
        meta["reasoning"] = parts.reasoning
        if reasoning_tokens is not None:
            meta["reasoning_tokens"] = reasoning_tokens
    if parts.calls:
        meta["tool_calls"] = [{"name": c.name, "arguments": c.arguments} for c in parts.calls]
    if json_answer:
        meta["json"] = True
    return meta


def calls_of(meta: dict) -> list[ToolCall]:
    return [ToolCall(c["name"], c.get("arguments", "{}")) for c in meta.get("tool_calls") or []
            if isinstance(c, dict) and isinstance(c.get("name"), str)]


def pretty_json(text: str) -> str | None:
    """``text`` indented, if it is JSON."""
    try:
        return json.dumps(json.loads(text), indent=2, ensure_ascii=False)
    except ValueError:
        return None


def call_title(call: ToolCall) -> str:
    """``called get_weather({"city": "Paris"})``, the arguments shortened."""
    args = call.arguments
    with contextlib.suppress(ValueError):
        args = json.dumps(json.loads(args), ensure_ascii=False)
    if len(args) > CALL_ARGS_CHARS:
        args = args[:CALL_ARGS_CHARS - 1] + "…"
    return f"called {call.name}({args})"


def thought_title(tokens: int | None, *, streaming: bool = False) -> str:
    if streaming:
        return "Thinking…"
    return f"Thought for {tokens:,} tokens" if tokens is not None else "Thought"


def markdown_text(parts: AnswerParts, *, json_answer: bool = False) -> str:
    """What the answer's markdown shows: a JSON answer as an indented code block."""
    if json_answer and (pretty := pretty_json(parts.content)) is not None:
        return f"```json\n{pretty}\n```"
    return parts.content


def export_text(message_content: str, meta: dict) -> str:
    """An answer for a Markdown export: its reasoning folded in a <details>, its calls
    named with their arguments as JSON, then the text."""
    lines: list[str] = []
    if meta.get("reasoning"):
        lines += [f"<details><summary>{thought_title(meta.get('reasoning_tokens'))}"
                  "</summary>", "", *(("> " + ln) if ln else ">" for ln in
                                      meta["reasoning"].splitlines()), "", "</details>", ""]
    if meta.get("json") and (pretty := pretty_json(message_content)) is not None:
        lines += ["```json", pretty, "```", ""]
    elif message_content:
        lines += [message_content, ""]
    for call in calls_of(meta):
        body = pretty_json(call.arguments) or call.arguments
        lines += [f"**Called `{call.name}`:**", "", "```json", body, "```", ""]
    return "\n".join(lines).rstrip()
