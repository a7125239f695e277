"""The help screen (F1 or ?): every key of the chat, read from the bindings themselves.

Reading the widgets' ``BINDINGS`` keeps the list true when a key changes; the few things
that are not bindings (a click, a ``/doc`` line) are added by hand in `EXTRA`.
"""

from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from app.tui.screens.conversations import ConversationsScreen
from app.tui.screens.models import ModelsScreen
from app.tui.widgets.prompt_input import PromptInput
from app.tui.widgets.transcript import MessageBox

KEY_NAMES = {"up": "↑", "down": "↓", "question_mark": "?", "slash": "/", "escape": "Esc",
             "enter": "Enter", "delete": "Del", "alt+enter": "Alt+Enter"}
EXTRA = {
    "Chat": [("/doc FILE", "attach a document (/doc alone picks one, /doc off detaches)"),
             ("/json", "answer the next questions in JSON (constrained decoding; /json off)")],
    "The prompt": [("↑", "on the first line: select the newest message")],
    "A selected message (↑ from the prompt, or click it)": [
        ("Esc", "back to the prompt"),
        ("click", "a folded line (reasoning, a tool call) opens or closes it")],
}


def key_name(key: str) -> str:
    """A binding's key as the help shows it: "ctrl+n" -> "Ctrl+N", "up" -> "↑"."""
    if key in KEY_NAMES:
        return KEY_NAMES[key]
    if len(key) == 1:
        return key
    return "+".join(part.upper() if len(part) == 1 else part.capitalize()
                    for part in key.split("+"))


def key_rows(bindings: list[BindingType]) -> list[tuple[str, str]]:
    """(keys, description) of each described binding, its alternative keys joined by " / "."""
    rows = []
    for b in bindings:
        binding = b if isinstance(b, Binding) else Binding(*b)
        if not binding.description or binding.system:
            continue
        keys = " / ".join(key_name(k.strip()) for k in binding.key.split(","))
        rows.append((keys, binding.tooltip or binding.description))
    return rows


def help_sections(app_bindings: list[BindingType]) -> dict[str, list[tuple[str, str]]]:
    """The help's sections: the app's keys, the prompt's, a message's, the lists'."""
    from app.tui.screens.chat import ChatScreen  # the chat screen imports the screens here

    prompt = [b for b in PromptInput.BINDINGS if isinstance(b, Binding)
              and b.action in ("submit", "newline", "recall", "clear_prompt")]
    sections = {
        "Chat": key_rows(app_bindings) + key_rows(ChatScreen.BINDINGS),
        "The prompt": key_rows(prompt),
        "A selected message (↑ from the prompt, or click it)": key_rows(MessageBox.BINDINGS),
        "Conversations (F4)": key_rows(ConversationsScreen.BINDINGS),
        "Models (F3)": key_rows(ModelsScreen.BINDINGS),
    }
    for name, rows in EXTRA.items():
        sections[name] = sections.get(name, []) + rows
    return sections


class HelpScreen(ModalScreen[None]):
    """Every key, grouped by where it works; Esc, F1 or ? closes it."""

    BINDINGS = [Binding("escape,f1,question_mark,q", "dismiss(None)", "Close")]

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog -wide -tall", id="help"):
            yield Static("Keys — Esc closes", classes="question")
            with VerticalScroll():
                yield Static(self.render_keys(), id="help-keys")

    def render_keys(self) -> Group:
        parts: list = []
        for section, rows in help_sections(self.app.BINDINGS).items():
            table = Table.grid(padding=(0, 2))
            table.add_column(style="bold", no_wrap=True, min_width=12)
            table.add_column()
            for keys, description in rows:
                table.add_row(keys, description)
            parts += [Text(section, style="bold underline"), table, Text("")]
        return Group(*parts)
