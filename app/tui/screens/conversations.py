"""Saved conversations: open, delete, start a new one."""

from __future__ import annotations

import time
from dataclasses import dataclass

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.message import Message
from textual.screen import ModalScreen
from textual.widgets import DataTable, Footer, Static

from app.conversations import ConversationStore
from app.tui.screens.dialogs import ConfirmScreen

NEW = "new"


@dataclass
class ConversationDeleted(Message):
    """A saved conversation was deleted (the chat may be showing it)."""

    conversation_id: str


class ConversationsScreen(ModalScreen[str | None]):
    """Lists saved chats; dismisses with a conversation id, "new", or None."""

    BINDINGS = [
        Binding("escape", "dismiss(None)", "Back"),
        Binding("enter", "open", "Open", priority=True),
        Binding("d,delete", "delete", "Delete"),
        Binding("n", "dismiss('new')", "New chat"),
    ]

    def __init__(self, store: ConversationStore):
        super().__init__()
        self.store = store

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog -wide -tall"):
            yield Static("Conversations", classes="question")
            yield DataTable(id="conversations", cursor_type="row", zebra_stripes=True)
            yield Static("", id="conversations-empty", classes="muted")
        yield Footer()

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        table.add_columns("title", "model", "messages", "updated")
        self.reload()
        table.focus()

    def reload(self) -> None:
        table = self.query_one(DataTable)
        table.clear()
        for s in self.store.list():
            updated = time.strftime("%Y-%m-%d %H:%M", time.localtime(s.updated))
            table.add_row(s.title, s.model or "", str(s.num_messages), updated, key=s.id)
        self.query_one("#conversations-empty", Static).update(
            "" if table.row_count else "No saved conversations yet (n starts a new one).")

    def _selected(self) -> str | None:
        table = self.query_one(DataTable)
        if not table.row_count:
            return None
        return table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value

    def action_open(self) -> None:
        if (cid := self._selected()) is not None:
            self.dismiss(cid)

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        self.dismiss(event.row_key.value)

    def action_delete(self) -> None:
        cid = self._selected()
        if cid is None:
            return

        def done(yes: bool | None) -> None:
            if yes:
                self.store.delete(cid)
                self.app.post_message(ConversationDeleted(cid))
                self.reload()

        self.app.push_screen(ConfirmScreen("Delete this conversation?"), done)

