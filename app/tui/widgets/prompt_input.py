"""The prompt: a multi-line text area where Enter sends and Ctrl+J / Alt+Enter add a newline."""

from __future__ import annotations

from dataclasses import dataclass

from textual import events
from textual.binding import Binding
from textual.message import Message
from textual.widgets import TextArea

NEWLINE_KEYS = ("ctrl+j", "alt+enter", "shift+enter")  # shift+enter: only some terminals


class PromptInput(TextArea):
    """Multi-line prompt. Enter posts `Submitted`; ctrl+j (or alt+enter) inserts a newline."""

    DEFAULT_CSS = """
    PromptInput { height: auto; min-height: 3; max-height: 12; border: round $primary 50%; }
    PromptInput:focus { border: round $primary; }
    """

    BINDINGS = [
        Binding("enter", "submit", "Send", key_display="⏎"),
        Binding("ctrl+j,alt+enter", "newline", "Newline", key_display="^j"),
    ]

    @dataclass
    class Submitted(Message):
        """The user pressed Enter: the prompt text as typed."""

        prompt_input: PromptInput
        text: str

        @property
        def control(self) -> PromptInput:
            return self.prompt_input

    def __init__(self, **kwargs):
        kwargs.setdefault("soft_wrap", True)
        kwargs.setdefault("show_line_numbers", False)
        kwargs.setdefault("tab_behavior", "focus")
        super().__init__(**kwargs)

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            self.action_submit()
            return
        if event.key in NEWLINE_KEYS:
            event.stop()
            event.prevent_default()
            self.action_newline()
            return
        await super()._on_key(event)

    def action_submit(self) -> None:
        self.post_message(self.Submitted(self, self.text))

    def action_newline(self) -> None:
        self.insert("\n")
