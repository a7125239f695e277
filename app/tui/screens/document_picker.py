"""The document picker (``/doc`` alone, or the palette): a directory tree to choose a file."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import DirectoryTree, Static


class DocumentTree(DirectoryTree):
    """A directory tree without hidden files and folders (dotfiles are rarely documents)."""

    def filter_paths(self, paths: Iterable[Path]) -> Iterable[Path]:
        return [p for p in paths if not p.name.startswith(".")]


class DocumentPicker(ModalScreen[str | None]):
    """Choose a text, Markdown or PDF file; dismisses with its path, or None."""

    BINDINGS = [Binding("escape", "dismiss(None)", "Cancel"),
                Binding("backspace", "parent", "Up a folder")]

    def __init__(self, root: str | Path = "."):
        super().__init__()
        self.root = Path(root).expanduser().resolve()

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog -wide -tall"):
            yield Static("Attach a document (text, Markdown or PDF)", classes="question")
            yield Static(str(self.root), id="picker-root", classes="label")
            yield DocumentTree(self.root, id="picker-tree")
            yield Static("Enter opens a folder or picks a file · Backspace: up a folder · "
                         "Esc: cancel", classes="label")

    def on_mount(self) -> None:
        self.query_one(DocumentTree).focus()

    def action_parent(self) -> None:
        tree = self.query_one(DocumentTree)
        parent = Path(tree.path).parent
        tree.path = parent
        self.query_one("#picker-root", Static).update(str(parent))

    def on_directory_tree_file_selected(self, event: DirectoryTree.FileSelected) -> None:
        event.stop()
        self.dismiss(str(event.path))
