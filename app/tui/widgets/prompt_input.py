"""The prompt: a multi-line text area where Enter sends and Ctrl+J / Alt+Enter add a newline.

Ctrl+R brings back the questions sent before (each press an older one), Ctrl+L clears the
prompt (Ctrl+Z undoes it).

A paste of `LARGE_PASTE_CHARS` or more is not inserted: the prompt posts `LargePaste`,
and the chat offers to attach it as a document (a whole book does not fit in a message,
and as a document it is placed by the budget policy and its prefix is cached).
"""

from __future__ import annotations

from dataclasses import dataclass

from textual import events
from textual.binding import Binding
from textual.message import Message
from textual.widgets import TextArea

NEWLINE_KEYS = ("ctrl+j", "alt+enter", "shift+enter")  # shift+enter: only some terminals
LARGE_PASTE_CHARS = 10_000  # ~2,500 tokens, several pages: a document rather than a message


class PromptInput(TextArea):
    """Multi-line prompt. Enter posts `Submitted`; ctrl+j (or alt+enter) inserts a newline."""

    DEFAULT_CSS = """
    PromptInput { height: auto; min-height: 3; max-height: 12; border: round $primary 50%; }
    PromptInput:focus { border: round $primary; }
    """

    BINDINGS = [
        Binding("enter", "submit", "Send", key_display="⏎"),
        Binding("ctrl+j,alt+enter", "newline", "Newline", key_display="^j", show=False),
        Binding("ctrl+r", "recall", "Previous question", key_display="^r", show=False),
        Binding("ctrl+l", "clear_prompt", "Clear the prompt", key_display="^l", show=False),
    ]

    @dataclass
    class Submitted(Message):
        """The user pressed Enter: the prompt text as typed."""

        prompt_input: PromptInput
        text: str

        @property
        def control(self) -> PromptInput:
            return self.prompt_input

    @dataclass
    class LargePaste(Message):
        """A paste of `LARGE_PASTE_CHARS` or more, not inserted (the chat decides)."""

        prompt_input: PromptInput
        text: str

        @property
        def control(self) -> PromptInput:
            return self.prompt_input

    @dataclass
    class UpFromTop(Message):
        """↑ on the first line: the chat moves the focus to the newest message."""

        prompt_input: PromptInput

        @property
        def control(self) -> PromptInput:
            return self.prompt_input

    def __init__(self, **kwargs):
        kwargs.setdefault("soft_wrap", True)
        kwargs.setdefault("show_line_numbers", False)
        kwargs.setdefault("tab_behavior", "focus")
        super().__init__(**kwargs)
        self.submits_in_flight = 0  # Submitted posted, not yet handled (the chat counts it)
        self.sent: list[str] = []  # the questions sent, oldest first (Ctrl+R recalls them)
        self._recalled: int | None = None  # the index in `sent` shown now

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            self.action_submit()
            return
        if event.key == "up" and self.cursor_location[0] == 0 and not self.selected_text:
            event.stop()
            event.prevent_default()
            self.post_message(self.UpFromTop(self))
            return
        if event.key in NEWLINE_KEYS:
            event.stop()
            event.prevent_default()
            self.action_newline()
            return
        await super()._on_key(event)

    async def _on_paste(self, event: events.Paste) -> None:
        if len(event.text) >= LARGE_PASTE_CHARS and not self.read_only:
            event.stop()
            event.prevent_default()  # TextArea's own handler would insert it
            self.post_message(self.LargePaste(self, event.text))
        # a small paste: TextArea's handler (next in the MRO) inserts it as usual

    def action_submit(self) -> None:
        if self.text.strip() and (not self.sent or self.sent[-1] != self.text):
            self.sent.append(self.text)
        self._recalled = None
        self.submits_in_flight += 1
        self.post_message(self.Submitted(self, self.text))

    def action_recall(self) -> None:
        """Show the question sent before the one shown (after the oldest: empty)."""
        if not self.sent:
            return
        shown = len(self.sent) if self._recalled is None else self._recalled
        self._recalled = shown - 1 if shown > 0 else None
        self.text = self.sent[self._recalled] if self._recalled is not None else ""
        self.move_cursor(self.document.end)

    def action_clear_prompt(self) -> None:
        self.clear()

    def action_newline(self) -> None:
        self.insert("\n")

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        # TextArea binds F6 to "select line"; the app's F6 (settings) matters more than a
        # shortcut shift+arrows and the mouse also give. Disabled, the binding leaves the
        # key (and the footer's F6) to the app.
        if action == "select_line":
            return False
        return super().check_action(action, parameters)
