"""The transcript: a bottom-anchored scroll of message boxes, answers streamed as markdown.

A message box can be focused (↑/↓ from the prompt, or a click) and acted on: copy, retry,
edit, delete, and Enter opens or closes its folds. The box only asks (`MessageBox.Act`);
the chat screen, which owns the conversation, decides. An answer's reasoning and tool
calls are folded lines around its text (`widgets.folds`, split by `app.tui.answer`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.message import Message
from textual.widgets import Markdown, Static
from textual.widgets.markdown import MarkdownStream

from app.conversations import ChatMessage
from app.tui.answer import (
    AnswerParts,
    AnswerStream,
    calls_of,
    markdown_text,
    parts_meta,
    split_answer,
)
from app.tui.widgets.folds import Fold, ReasoningFold, tool_call_folds

SHOW_CHARS = 4000  # a huge paste is kept whole in the chat, shown shortened


def shorten(text: str, limit: int = SHOW_CHARS) -> str:
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n\n*… {len(text) - limit:,} more characters not shown*"


class MessageBox(Vertical, can_focus=True):
    """One message: a role label, the text as markdown, and a stats line under answers.

    ``message`` is the conversation's `ChatMessage` it shows; None while the turn runs.
    """

    BINDINGS = [
        Binding("c,y", "act('copy')", "Copy"),
        Binding("r", "act('retry')", "Retry"),
        Binding("e", "act('edit')", "Edit"),
        Binding("d,delete", "act('delete')", "Delete turn"),
        Binding("enter", "toggle_folds", "Fold/unfold"),
        Binding("up,k", "act('previous')", "Previous message", show=False),
        Binding("down,j", "act('next')", "Next message (after the last: the prompt)",
                show=False),
    ]

    @dataclass
    class Act(Message):
        """The user asked for ``action`` (copy, retry, edit, delete, previous, next)."""

        box: MessageBox
        action: str

    DEFAULT_CSS = """
    MessageBox { height: auto; margin: 0 0 1 0; padding: 0 1; }
    MessageBox:focus { background: $primary 15%; border-left: thick $accent; }
    MessageBox.-cancelled { border-left: thick $warning; }
    MessageBox > .role { color: $text-muted; text-style: bold; }
    MessageBox.-user { border-left: thick $secondary; background: $boost; }
    MessageBox.-assistant { border-left: thick $primary; }
    MessageBox.-streaming { border-left: thick $accent; }
    MessageBox.-error { border-left: thick $error; }
    MessageBox > Markdown { margin: 0; padding: 0; background: transparent; }
    MessageBox > Markdown > *:last-child { margin-bottom: 0; }
    MessageBox > Markdown > *:first-child { margin-top: 0; }
    MessageBox > .stats { color: $text-muted; height: auto; }
    MessageBox > .stats.-error { color: $error; }
    MessageBox > .calls { height: auto; }
    """

    def __init__(self, role: str, content: str = "", stats: str = "", *, error: bool = False,
                 message: ChatMessage | None = None):
        super().__init__(classes=f"-{role}" + (" -error" if error else ""))
        self.role = role
        self.text = content
        self.message = message
        self._stats = stats
        self._error = error
        self._stream: MarkdownStream | None = None
        meta = message.meta if message is not None else {}
        self.raw = content  # what the model wrote, reasoning and calls included
        self.json_answer = bool(meta.get("json"))
        self.parts = AnswerParts(content, meta.get("reasoning") or "", calls_of(meta))
        self.reasoning_tokens: int | None = meta.get("reasoning_tokens")
        self._splitter: AnswerStream | None = None

    def compose(self) -> ComposeResult:
        yield Static(self._label(), classes="role")
        fold = ReasoningFold(self.parts.reasoning, self.reasoning_tokens)
        fold.display = bool(self.parts.reasoning)
        yield fold
        yield Markdown(shorten(self.text) if self.role == "user"
                       else markdown_text(self.parts, json_answer=self.json_answer))
        calls = Vertical(*tool_call_folds(self.parts.calls), classes="calls")
        calls.display = bool(self.parts.calls)
        yield calls
        stats = Static(self._stats, classes="stats -error" if self._error else "stats")
        stats.display = bool(self._stats)
        yield stats

    def _label(self) -> str:
        if self.role == "user":
            return "You"
        reason = self.message.meta.get("finish_reason") if self.message is not None else None
        return {"cancelled": "Assistant · cancelled, partial answer",
                "shutdown": "Assistant · stopped, partial answer",
                "error": "Assistant · failed, partial answer"}.get(reason or "", "Assistant")

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        # retry is for answers, edit for questions: the footer shows what applies here
        if action == "act" and parameters:
            if parameters[0] == "retry":
                return self.role == "assistant"
            if parameters[0] == "edit":
                return self.role == "user"
        if action == "toggle_folds":
            return any(f.display for f in self.query(Fold))
        return True

    def action_toggle_folds(self) -> None:
        """Enter: open the answer's folds (reasoning, tool calls), or close them."""
        folds = [f for f in self.query(Fold) if f.display]
        collapsed = not all(f.collapsed for f in folds)
        for fold in folds:
            fold.collapsed = collapsed

    def action_act(self, action: str) -> None:
        self.post_message(self.Act(self, action))

    def attach(self, message: ChatMessage) -> None:
        """Link the box to its saved message (the turn ended); a partial answer is marked."""
        self.message = message
        reason = message.meta.get("finish_reason")
        self.set_class(reason in ("cancelled", "shutdown"), "-cancelled")
        self.query_one(".role", Static).update(self._label())

    @property
    def markdown(self) -> Markdown:
        return self.query_one(Markdown)

    async def append(self, text: str) -> None:
        """Stream a delta: reasoning into its fold, the text into the markdown (appended,
        not re-rendered from scratch); what may be a tool call is held until the end."""
        if not text:
            return
        self.raw += text
        if self._splitter is None:
            self._splitter = AnswerStream()
            self.add_class("-streaming")
        reasoning, content = self._splitter.feed(text)
        if reasoning:
            fold = self.query_one(ReasoningFold)
            if not fold.display:
                fold.display = True
                fold.set_title("Thinking…")
            fold.write(reasoning)
        if content:
            self.text += content
            if self._stream is None:
                self._stream = Markdown.get_stream(self.markdown)
            await self._stream.write(content)

    @property
    def copy_text(self) -> str:
        """What c (or Ctrl+C) copies: the text, and the tool calls written out whole."""
        calls = [f"called {c.name}({c.arguments})" for c in self.parts.calls]
        return "\n\n".join(t for t in (self.text, *calls) if t)

    def parts_meta(self) -> dict:
        """The parts a saved message keeps besides its text."""
        return parts_meta(self.parts, reasoning_tokens=self.reasoning_tokens,
                          json_answer=self.json_answer)

    async def _end_stream(self) -> None:
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None
            # the stop cancels the stream's task but not the append it had begun (shielded):
            # that append holds the markdown's lock, so taking it waits for it to end, else
            # it would go on mounting after the screen is gone (MountError at quit)
            async with self.markdown.lock:
                pass

    async def settle(self, raw: str | None = None,
                     count: Callable[[str], int] | None = None) -> None:
        """End streaming and show the answer's final parts (of ``raw`` if given: an answer
        cut back); ``count`` tokens the reasoning for its fold's title."""
        await self._end_stream()
        self._splitter = None
        if raw is not None:
            self.raw = raw
        parts = self.parts = split_answer(self.raw, json_answer=self.json_answer)
        if count is not None and parts.reasoning:
            try:
                self.reasoning_tokens = count(parts.reasoning)
            except Exception:  # a tokenizer gone with its engine: the title says less
                self.reasoning_tokens = None
        fold = self.query_one(ReasoningFold)
        fold.display = bool(parts.reasoning)
        fold.done(parts.reasoning, self.reasoning_tokens)
        shown = markdown_text(parts, json_answer=self.json_answer)
        if parts.content != self.text or shown != parts.content:
            await self.markdown.update(shown)
        self.text = parts.content
        calls = self.query_one(".calls", Vertical)
        if calls.children or parts.calls:
            await calls.remove_children()
            await calls.mount_all(list(tool_call_folds(parts.calls)))
        calls.display = bool(parts.calls)

    async def finish(self, stats: str, *, error: bool = False) -> None:
        """End streaming and show the stats (or the error) under the answer."""
        if self._splitter is not None:  # still streaming: its parts were not settled
            await self.settle()
        await self._end_stream()
        self.remove_class("-streaming")
        self.set_class(error, "-error")
        self.set_stats(stats, error=error)

    def set_stats(self, stats: str, *, error: bool = False) -> None:
        label = self.query_one(".stats", Static)
        label.set_class(error, "-error")
        label.update(stats)
        label.display = bool(stats)


class Transcript(VerticalScroll):
    """The chat so far; stays scrolled to the newest message unless the user scrolls up."""

    DEFAULT_CSS = """
    Transcript { height: 1fr; padding: 0 1; }
    Transcript > .hint { color: $text-muted; margin: 1 2; }
    """

    def on_mount(self) -> None:
        self.anchor()

    async def clear(self) -> None:
        await self.remove_children()

    async def add(self, role: str, content: str = "", stats: str = "", *,
                  error: bool = False, message: ChatMessage | None = None) -> MessageBox:
        box = MessageBox(role, content, stats, error=error, message=message)
        await self.mount(box)
        if message is not None:
            box.attach(message)
        self.anchor()
        return box

    @property
    def boxes(self) -> list[MessageBox]:
        """The message boxes, oldest first."""
        return list(self.query_children(MessageBox))

    async def show_hint(self, text: str) -> None:
        await self.mount(Static(text, classes="hint"))
