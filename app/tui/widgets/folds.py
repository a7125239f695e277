"""Folded parts of an answer: its reasoning and the tool calls it wrote.

Each is a one-line `Collapsible` ("▶ Thought for 212 tokens", "▶ called get_weather({…})")
that opens on a click or Enter (on the line, or on its selected message). Titles and
bodies are plain text: a model's ``[`` and ``{`` are never read as markup.
"""

from __future__ import annotations

from textual.app import ComposeResult
from textual.content import Content
from textual.widgets import Collapsible, Static

from app.tool_calls import ToolCall
from app.tui.answer import call_title, pretty_json, thought_title


class Fold(Collapsible):
    """A one-line fold inside a message box."""

    DEFAULT_CSS = """
    Fold { background: transparent; border-top: none; padding: 0; margin: 0 0 1 0; }
    Fold > Contents { padding: 0 0 0 2; }
    Fold > CollapsibleTitle { padding: 0; color: $text-muted; }
    Fold > Contents > Static { color: $text-muted; }
    """

    def __init__(self, title: str, body: str, *, classes: str = ""):
        self.body = Static(Content(body))
        super().__init__(self.body, title=Content(title), collapsed=True,  # type: ignore[arg-type]
                         classes=classes)

    def set_title(self, title: str) -> None:
        self.title = Content(title)  # type: ignore[assignment]


class ReasoningFold(Fold):
    """The answer's reasoning; while it streams, written into as it comes."""

    def __init__(self, text: str = "", tokens: int | None = None, *, streaming: bool = False):
        super().__init__(thought_title(tokens, streaming=streaming), text, classes="reasoning")
        self.text = text

    def write(self, text: str) -> None:
        self.text += text
        self.body.update(Content(self.text))

    def done(self, text: str, tokens: int | None) -> None:
        self.text = text
        self.body.update(Content(text))
        self.set_title(thought_title(tokens))


class ToolCallFold(Fold):
    """One tool call: its name and arguments; open, the arguments indented."""

    def __init__(self, call: ToolCall):
        super().__init__(call_title(call), pretty_json(call.arguments) or call.arguments,
                         classes="tool-call")
        self.call = call


def tool_call_folds(calls: list[ToolCall]) -> ComposeResult:
    for call in calls:
        yield ToolCallFold(call)
