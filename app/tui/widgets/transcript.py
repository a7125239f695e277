"""The transcript: a bottom-anchored scroll of message boxes, answers streamed as markdown."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Vertical, VerticalScroll
from textual.widgets import Markdown, Static
from textual.widgets.markdown import MarkdownStream

SHOW_CHARS = 4000  # a huge paste is kept whole in the chat, shown shortened


def shorten(text: str, limit: int = SHOW_CHARS) -> str:
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n\n*… {len(text) - limit:,} more characters not shown*"


class MessageBox(Vertical):
    """One turn: a role label, the text as markdown, and a stats line under answers."""

    DEFAULT_CSS = """
    MessageBox { height: auto; margin: 0 0 1 0; padding: 0 1; }
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
    """

    def __init__(self, role: str, content: str = "", stats: str = "", *, error: bool = False):
        super().__init__(classes=f"-{role}" + (" -error" if error else ""))
        self.role = role
        self.text = content
        self._stats = stats
        self._error = error
        self._stream: MarkdownStream | None = None

    def compose(self) -> ComposeResult:
        yield Static("You" if self.role == "user" else "Assistant", classes="role")
        yield Markdown(shorten(self.text) if self.role == "user" else self.text)
        stats = Static(self._stats, classes="stats -error" if self._error else "stats")
        stats.display = bool(self._stats)
        yield stats

    @property
    def markdown(self) -> Markdown:
        return self.query_one(Markdown)

    async def append(self, text: str) -> None:
        """Stream a delta into the markdown (appended, not re-rendered from scratch)."""
        if not text:
            return
        self.text += text
        if self._stream is None:
            self.add_class("-streaming")
            self._stream = Markdown.get_stream(self.markdown)
        await self._stream.write(text)

    async def finish(self, stats: str, *, error: bool = False) -> None:
        """End streaming and show the stats (or the error) under the answer."""
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None
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
                  error: bool = False) -> MessageBox:
        box = MessageBox(role, content, stats, error=error)
        await self.mount(box)
        self.anchor()
        return box

    async def show_hint(self, text: str) -> None:
        await self.mount(Static(text, classes="hint"))
