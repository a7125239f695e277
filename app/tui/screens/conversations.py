"""Saved conversations: search, open, rename, export, delete, start a new one.

Titles are cut to their column by terminal cells (`rich.cells`), not characters, so a
title in CJK or with emoji keeps the columns where they are.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.message import Message
from textual.screen import ModalScreen
from textual.widgets import DataTable, Footer, Input, Static

from app.conversations import ConversationError, ConversationStore, fit_cells
from app.tui.export import ask_export
from app.tui.model_host import model_name
from app.tui.screens.dialogs import ConfirmScreen, TextInputScreen

NEW = "new"
COUNT_CELLS, DATE_CELLS = 8, 16  # fixed columns; the model gets up to 24, the title the rest


@dataclass
class ConversationDeleted(Message):
    """A saved conversation was deleted (the chat may be showing it)."""

    conversation_id: str


class ConversationsScreen(ModalScreen[str | None]):
    """Lists saved chats; dismisses with a conversation id, "new", or None.

    Typing in the search box (``/``) keeps the chats whose title or text holds every word;
    the one-letter keys act on the selected row while the list has the focus. ``/`` moves
    the focus at once (a priority binding), so the keys typed right after it, in the same
    burst, go to the search box and never act on a chat.
    """

    # the list has the focus from the first frame (the default took the search box, so a
    # "/" typed in the burst that opened the screen was taken as search text)
    AUTO_FOCUS = "#conversations"
    BINDINGS = [
        Binding("escape", "dismiss(None)", "Back"),
        Binding("enter", "open", "Open", priority=True),
        Binding("slash,ctrl+f", "search", "Search", key_display="/", priority=True),
        Binding("r", "rename", "Rename"),
        Binding("e", "export", "Export"),
        Binding("d,delete", "delete", "Delete"),
        Binding("n", "dismiss('new')", "New chat"),
    ]

    @dataclass
    class Renamed(Message):
        """A chat was renamed here (the chat on screen may be it)."""

        conversation_id: str
        title: str

    def __init__(self, store: ConversationStore, current: str | None = None):
        super().__init__()
        self.store = store
        self.current = current

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog -wide -tall"):
            yield Static("Conversations", classes="question")
            yield Input(placeholder="search titles and text…", id="conversation-search")
            yield DataTable(id="conversations", cursor_type="row", zebra_stripes=True)
            yield Static("", id="conversations-empty", classes="muted")
        yield Footer()

    def on_mount(self) -> None:
        self.reload()
        self.query_one(DataTable).focus()

    def on_resize(self) -> None:
        self.reload()

    @property
    def query_text(self) -> str:
        return self.query_one("#conversation-search", Input).value.strip()

    def column_cells(self) -> tuple[int, int]:
        """(title, model) widths at the table's width."""
        table = self.query_one(DataTable)
        width = table.size.width or self.app.size.width
        model = max(8, min(24, width // 6))
        # the other columns, a cell of padding each side of every column, and the scrollbar
        return max(12, width - model - COUNT_CELLS - DATE_CELLS - 4 * 2 - 2), model

    def title_cells(self) -> int:
        return self.column_cells()[0]

    def reload(self) -> None:
        table = self.query_one(DataTable)
        keep = self._selected()
        table.clear(columns=True)
        title, model = self.column_cells()
        table.add_column("title", width=title)
        table.add_column("model", width=model)
        table.add_column("messages", width=COUNT_CELLS)
        table.add_column("updated", width=DATE_CELLS)
        for s in self.store.list(self.query_text):
            updated = time.strftime("%Y-%m-%d %H:%M", time.localtime(s.updated))
            mark = "▸ " if s.id == self.current else ""  # the chat on screen
            table.add_row(Text(fit_cells(mark + s.title, title), no_wrap=True),
                          Text(fit_cells(model_name(s.model) if s.model else "", model),
                               no_wrap=True),
                          str(s.num_messages), updated, key=s.id)
        if keep is not None and keep in table.rows:
            table.move_cursor(row=table.get_row_index(keep))
        empty = ("No chat matches the search." if self.query_text
                 else "No saved conversations yet (n starts a new one).")
        self.query_one("#conversations-empty", Static).update(
            "" if table.row_count else empty)

    def on_input_changed(self, event: Input.Changed) -> None:
        self.reload()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.query_one(DataTable).focus()

    def action_search(self) -> None:
        search = self.query_one("#conversation-search", Input)
        if self.focused is search:  # a "/" typed in the search box is text (after the keys
            search.call_later(search.insert_text_at_cursor, "/")  # before it, queued there)
            return
        self.set_focus(search)  # now, not after the keys already queued behind "/"

    def on_key(self, event) -> None:
        # ↓ in the search box goes to the list, as Enter does
        if event.key == "down" and isinstance(self.focused, Input):
            event.stop()
            self.query_one(DataTable).focus()

    def _selected(self) -> str | None:
        table = self.query_one(DataTable)
        if not table.row_count:
            return None
        return table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value

    def action_open(self) -> None:
        if isinstance(self.focused, Input):  # Enter in the search box: go to the list
            self.query_one(DataTable).focus()
            return
        if (cid := self._selected()) is not None:
            self.dismiss(cid)

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        self.dismiss(event.row_key.value)

    def action_rename(self) -> None:
        cid = self._selected()
        if cid is None:
            return
        try:
            conversation = self.store.load(cid)
        except ConversationError as e:
            self.notify(str(e), severity="error")
            return

        def done(title: str | None) -> None:
            if not title:
                return
            conversation.title = title
            self.store.save(conversation)
            self.app.post_message(self.Renamed(cid, title))
            self.reload()

        self.app.push_screen(TextInputScreen("Rename the chat", conversation.title), done)

    def action_export(self) -> None:
        cid = self._selected()
        if cid is None:
            return
        try:
            ask_export(self.app, self.store.load(cid))
        except ConversationError as e:
            self.notify(str(e), severity="error")

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
