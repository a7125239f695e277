"""Models: the local list (embedded default + hub cache), download by repo id, delete."""

from __future__ import annotations

import time
from dataclasses import dataclass

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.screen import ModalScreen
from textual.widgets import Button, DataTable, Footer, Input, ProgressBar, Static

from app import models_hub
from app.models_hub import DownloadProgress, HubError, LocalModel
from app.tui.model_host import model_label
from app.tui.screens.dialogs import ConfirmScreen
from app.tui.widgets.cache_panel import fmt_bytes

PROGRESS_S = 0.1


@dataclass
class DownloadUpdate(Message):
    """Progress of the running download (posted from the download thread)."""

    progress: DownloadProgress


@dataclass
class DownloadDone(Message):
    """The download ended: ``error`` says why it failed, None on success."""

    repo_id: str
    error: str | None = None


class ModelsScreen(ModalScreen[str | None]):
    """Pick, download or delete a model; dismisses with the model to load, or None."""

    BINDINGS = [
        Binding("escape", "dismiss(None)", "Back"),
        Binding("ctrl+d", "delete", "Delete model"),
        Binding("ctrl+r", "reload", "Refresh"),
    ]

    def __init__(self, current: str | None = None):
        super().__init__()
        self.current = current
        self.models: dict[str, LocalModel] = {}
        self.downloading: str | None = None

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog -wide -tall"):
            yield Static("Models — Enter loads the selected one", classes="question")
            yield DataTable(id="models", cursor_type="row", zebra_stripes=True)
            with Horizontal(id="download-row"):
                yield Input(placeholder="owner/name, e.g. mlx-community/Qwen2.5-0.5B-Instruct-4bit",
                            id="repo-id")
                yield Button("Download", id="download", variant="primary")
            yield ProgressBar(id="download-bar", show_eta=False)
            yield Static("", id="download-status")
        yield Footer()

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        table.add_columns("model", "architecture", "source", "size", "")
        self.query_one(ProgressBar).display = False
        self.action_reload()
        table.focus()

    def action_reload(self) -> None:
        table = self.query_one(DataTable)
        table.clear()
        self.models = {m.name: m for m in models_hub.list_local_models()}
        for m in self.models.values():
            note = "loaded" if m.name == self.current else ("" if m.loadable else "no config.json")
            table.add_row(model_label(m.name), m.architecture, m.source,
                          fmt_bytes(m.size_bytes), note, key=m.name)

    def _selected(self) -> LocalModel | None:
        table = self.query_one(DataTable)
        if not table.row_count:
            return None
        key = table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value
        return self.models.get(key)

    def set_status(self, text: str, *, error: bool = False) -> None:
        status = self.query_one("#download-status", Static)
        status.set_class(error, "-error")
        status.update(text)

    # -- use ---------------------------------------------------------------------
    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        model = self.models.get(event.row_key.value)
        if model is None:
            return
        if not model.loadable:
            self.set_status(f"{model.name} has no config.json: not a model kvchat can load",
                            error=True)
            return
        self.dismiss(model.name)

    # -- delete ------------------------------------------------------------------
    def action_delete(self) -> None:
        model = self._selected()
        if model is None:
            return
        if model.source == "embedded":
            self.set_status("The embedded default ships with kvchat; it cannot be deleted.",
                            error=True)
            return
        if model.name == self.current:
            self.set_status("This model is loaded; switch to another one before deleting it.",
                            error=True)
            return

        def done(yes: bool | None) -> None:
            if not yes:
                return
            try:
                freed = models_hub.delete_model(model.name)
            except (HubError, OSError) as e:
                self.set_status(str(e), error=True)
                return
            self.set_status(f"Deleted {model.name} ({fmt_bytes(freed)} freed).")
            self.action_reload()

        self.app.push_screen(ConfirmScreen(f"Delete {model.name} from the hub cache?"), done)

    # -- download ----------------------------------------------------------------
    @on(Input.Submitted, "#repo-id")
    @on(Button.Pressed, "#download")
    def start_download(self) -> None:
        repo_id = self.query_one("#repo-id", Input).value.strip()
        if not repo_id:
            self.set_status("Type a repo id (owner/name) to download.", error=True)
            return
        if self.downloading:
            self.set_status(f"Already downloading {self.downloading}.", error=True)
            return
        self.downloading = repo_id
        bar = self.query_one(ProgressBar)
        bar.update(total=None, progress=0)
        bar.display = True
        self.set_status(f"Downloading {repo_id}…")
        self.download(repo_id)

    @work(thread=True, exclusive=True, group="download", exit_on_error=False)
    def download(self, repo_id: str) -> None:
        last = 0.0

        def report(p: DownloadProgress) -> None:
            nonlocal last
            now = time.monotonic()
            if now - last >= PROGRESS_S or (p.total_bytes and p.done_bytes >= p.total_bytes):
                last = now
                self.post_message(DownloadUpdate(p))

        try:
            models_hub.download_model(repo_id, on_progress=report)
        except HubError as e:
            self.post_message(DownloadDone(repo_id, str(e)))
        else:
            self.post_message(DownloadDone(repo_id))

    def on_download_update(self, message: DownloadUpdate) -> None:
        p = message.progress
        bar = self.query_one(ProgressBar)
        if p.total_bytes:
            bar.update(total=p.total_bytes, progress=p.done_bytes)
        files = f" · {p.done_files}/{p.total_files} files" if p.total_files else ""
        self.set_status(f"Downloading {self.downloading}: {fmt_bytes(p.done_bytes)}"
                        f" of {fmt_bytes(p.total_bytes)}{files}")

    def on_download_done(self, message: DownloadDone) -> None:
        self.downloading = None
        self.query_one(ProgressBar).display = False
        if message.error:
            self.set_status(message.error, error=True)
            self.notify(message.error, title="Download failed", severity="error")
            return
        self.set_status(f"Downloaded {message.repo_id}. Select it and press Enter to load it.")
        self.action_reload()
        table = self.query_one(DataTable)
        if message.repo_id in self.models:
            table.move_cursor(row=table.get_row_index(message.repo_id))
            table.focus()
