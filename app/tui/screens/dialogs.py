"""Small modals: a yes/no confirmation, a one-line text input and the system prompt editor."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Static, TextArea


class ConfirmScreen(ModalScreen[bool]):
    """Ask a yes/no question; dismisses with True on yes. The question is plain text (a
    file name's or a key's brackets are not markup).

    ``default``: the answer Enter gives (the focused button). No by default, as for a
    delete; an offer (attach a paste as a document) defaults to yes.
    """

    BINDINGS = [Binding("escape", "dismiss(False)", "No"), Binding("y", "dismiss(True)", "Yes")]

    def __init__(self, question: str, *, default: bool = False):
        super().__init__()
        self.question = question
        self.default = default

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Static(self.question, classes="question", markup=False)
            with Horizontal(classes="buttons"):
                yield Button("Yes", variant="primary" if self.default else "error", id="yes")
                yield Button("No", variant="default" if self.default else "primary", id="no")

    def on_mount(self) -> None:
        self.query_one("#yes" if self.default else "#no", Button).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")


class TextInputScreen(ModalScreen[str | None]):
    """Ask for one line of text (a chat's new name, a file to export to).

    Dismisses with the text, stripped, on Enter; None on Esc or when it is empty.
    """

    BINDINGS = [Binding("escape", "dismiss(None)", "Cancel")]

    def __init__(self, question: str, value: str = ""):
        super().__init__()
        self.question = question
        self.value = value

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog -wide"):
            yield Static(self.question, classes="question")
            yield Input(self.value, id="text-input")
            yield Static("Enter saves · Esc cancels", classes="muted")

    def on_mount(self) -> None:
        field = self.query_one(Input)
        field.focus()
        field.select_all()  # typing replaces the proposal; an arrow key keeps it to edit

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.dismiss(event.value.strip() or None)


class SystemPromptScreen(ModalScreen[str | None]):
    """Edit the conversation's system prompt; dismisses with the new text or None."""

    BINDINGS = [Binding("escape", "dismiss(None)", "Cancel"),
                Binding("ctrl+s", "save", "Save", priority=True)]

    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog -wide"):
            yield Static("System prompt (applies to this conversation)", classes="question")
            yield TextArea(self.text, id="system-text", soft_wrap=True)
            with Horizontal(classes="buttons"):
                yield Button("Save (ctrl+s)", variant="primary", id="save")
                yield Button("Cancel (esc)", id="cancel")

    def on_mount(self) -> None:
        self.query_one(TextArea).focus()

    def action_save(self) -> None:
        self.dismiss(self.query_one(TextArea).text.strip())

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "save":
            self.action_save()
        else:
            self.dismiss(None)
