"""The document bar: the documents attached to the chat, shown above the prompt.

It also attaches them: ``/doc PATH``, the file picker and a large paste all end here.
Reading a file (a PDF can take a while) and counting its tokens run in a thread; a
file that cannot be used shows its one-line `DocumentError` as a notice, nothing else
changes. Hidden while no document is attached.
"""

from __future__ import annotations

from collections.abc import Callable

from textual import work
from textual.widgets import Static

from app.documents.counting import sliced_counter
from app.documents.load import Document, document_from_text, load_document
from app.documents.qa import Prepared
from app.tui.documents import AttachedDocuments, DocCommand, bar_text, tokens_text
from app.tui.screens.dialogs import ConfirmScreen
from app.tui.screens.document_picker import DocumentPicker
from engine.errors import KVChatError


class DocumentBar(Static):
    """What is attached (``attached``), its size and how the last answer used it."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.attached: AttachedDocuments | None = None
        self.last: tuple[Prepared, object] | None = None  # the last answer's (prepared, stats)

    def on_mount(self) -> None:
        self.display = False

    def refresh_text(self) -> None:
        """Redraw from ``attached`` and ``last`` (hidden when nothing is attached)."""
        self.display = self.attached is not None
        if self.attached is not None:
            self.update("doc: " + bar_text(self.attached, self.last))

    # -- attaching -----------------------------------------------------------------
    def run(self, command: DocCommand) -> None:
        """Carry out a ``/doc`` command."""
        if command.action == "pick":
            self.pick()
        elif command.action == "detach":
            self.detach()
        else:
            self.attach_path(command.path)

    def pick(self) -> None:
        """Open the file picker; the chosen file is attached."""
        if isinstance(self.app.screen, DocumentPicker):
            return

        def chosen(path: str | None) -> None:
            if path is not None:
                self.attach_path(path)

        self.app.push_screen(DocumentPicker(), chosen)

    def detach(self, *, quiet: bool = False) -> None:
        """Detach every document: questions go to the model alone again."""
        if self.attached is None:
            if not quiet:
                self.notify("No document is attached.", severity="warning")
            return
        names, self.attached, self.last = self.attached.names, None, None
        self.refresh_text()
        if not quiet:
            self.notify(f"Detached {names}.", timeout=3)

    def attach_path(self, path: str) -> None:
        """Read the file at ``path`` in a thread and attach it (or say why not)."""
        self._read(lambda: load_document(path))

    def attach_text(self, text: str, name: str = "pasted text") -> None:
        """Attach ``text`` (a paste) as a document called ``name``."""
        self._read(lambda: document_from_text(text, name))

    def offer_text(self, text: str, why: str, *, declined: Callable[[], object] = lambda: None,
                   ) -> None:
        """Ask whether to attach ``text`` as a document (Enter: yes, Esc: no)."""
        def answered(yes: bool | None) -> None:
            if yes:
                self.attach_text(text)
            else:
                declined()

        question = f"{why}: attach it as a document?\n[Enter] yes / [Esc] no"
        self.app.push_screen(ConfirmScreen(question, default=True), answered)

    @work(thread=True, group="attach-document", exit_on_error=False)
    def _read(self, load: Callable[[], Document]) -> None:
        engine = getattr(self.app, "engine", None)
        try:
            doc = load()
            tokens = (sliced_counter(engine.count_tokens)(doc.text)  # bounded: a slice at once
                      if engine is not None else None)
        except (KVChatError, ValueError, OSError) as e:  # DocumentError above all
            line = str(e).splitlines()[0] if str(e) else type(e).__name__
            self.app.call_from_thread(self.notify, line, title="Cannot attach",
                                      severity="error", timeout=8)
            return
        self.app.call_from_thread(self._attached, doc, tokens)

    def _attached(self, doc: Document, tokens: int | None) -> None:
        # merged here, on the UI thread, so two attaches in flight both land
        if self.attached is not None and self.attached.holds(doc):
            self.notify(f"{doc.name} is already attached.", severity="warning")
            return
        self.attached = (self.attached.plus(doc, tokens) if self.attached is not None
                         else AttachedDocuments([doc], [tokens]))
        self.last = None
        self.refresh_text()
        self.notify(f"Attached {doc.name} ({tokens_text(tokens)}). Ask away; "
                    "/doc off detaches.", timeout=4)

    def answered(self, attached: AttachedDocuments, prepared: Prepared, stats: object) -> None:
        """An answer on ``attached`` finished: show how it used them (if still attached)."""
        if attached is not self.attached:
            return
        self.last = (prepared, stats)
        self.refresh_text()

