"""Documents attached to the chat: the ``/doc`` command, the attached set, its lines.

While documents are attached, each question goes through `DocumentQA.prepare`, the
policy ``kvchat ask`` uses: the documents go first, whole when they fit the budget (a
pinned prefix whose KV blocks the next question reuses), otherwise the chunks most
relevant to the question; what was left out is always shown. Nothing here draws: the
widget is `widgets.document_bar`, which runs the slow parts (reading, counting) in
threads.
"""

from __future__ import annotations

import os
import re
import shlex
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from app.documents.load import Document
from app.documents.qa import SYSTEM, DocumentQA, Prepared
from app.engine_like import EngineLike

DETACH_WORDS = frozenset({"off", "none", "clear", "detach"})
_DOC_COMMAND = re.compile(r"/doc(?:\s+(.*))?", re.DOTALL)


@dataclass(frozen=True, slots=True)
class DocCommand:
    """A ``/doc`` line: "pick" (a file picker), "attach" ``path``, or "detach"."""

    action: str
    path: str = ""


def parse_doc_command(text: str) -> DocCommand | None:
    """The ``/doc`` command ``text`` holds, or None when it is a message for the model.

    ``/doc`` alone picks a file, ``/doc off`` (or none, clear, detach) detaches, and
    ``/doc PATH`` attaches PATH (``~`` expanded; a quoted or backslash-escaped path, as
    a terminal pastes a dropped file, is unquoted).
    """
    m = _DOC_COMMAND.fullmatch(text.strip())
    if m is None:
        return None
    arg = (m.group(1) or "").strip()
    if not arg:
        return DocCommand("pick")
    if arg.lower() in DETACH_WORDS:
        return DocCommand("detach")
    return DocCommand("attach", unquote_path(arg))


def unquote_path(arg: str) -> str:
    """``arg`` as a path: as typed when that exists, else shell-unquoted if one word."""
    path = os.path.expanduser(arg)
    if os.path.exists(path):
        return path
    try:
        words = shlex.split(arg)
    except ValueError:  # an unbalanced quote: take it as typed
        return path
    return os.path.expanduser(words[0]) if len(words) == 1 else path


def document_system(chat_system: str) -> str:
    """The system text of a document question: the Q&A rules, then the chat's own."""
    return f"{SYSTEM}\n\n{chat_system}" if chat_system else SYSTEM


class AttachedDocuments:
    """The documents attached to one chat, and their `DocumentQA` (which caches chunks).

    One DocumentQA serves every question on the set; a new engine (a model switch, a
    KV format reload) gets a new one, as its tokenizer may count differently. Turns use
    it from their worker thread, hence the lock.
    """

    def __init__(self, docs: Sequence[Document], tokens: Sequence[int | None] = ()):
        self.docs = list(docs)
        self.tokens: list[int | None] = list(tokens) or [None] * len(self.docs)
        self._qa: DocumentQA | None = None
        self._lock = threading.Lock()

    def plus(self, doc: Document, tokens: int | None) -> AttachedDocuments:
        """A new set with ``doc`` added (a new set: a new DocumentQA, new chunks)."""
        return AttachedDocuments([*self.docs, doc], [*self.tokens, tokens])

    def holds(self, doc: Document) -> bool:
        """Whether a document with ``doc``'s content is in the set already."""
        return any(d.sha256 == doc.sha256 for d in self.docs)

    @property
    def names(self) -> str:
        """The documents' names, comma-separated."""
        return ", ".join(d.name for d in self.docs)

    @property
    def total_tokens(self) -> int | None:
        """The documents' tokens for the current model; None before a model counted them."""
        return None if None in self.tokens else sum(t or 0 for t in self.tokens)

    def qa_for(self, engine: EngineLike) -> DocumentQA:
        """This set's DocumentQA on ``engine`` (built, and the tokens counted, once)."""
        with self._lock:
            if self._qa is None or self._qa.engine is not engine:
                self._qa = DocumentQA(engine, self.docs)
                self.tokens = list(self._qa.doc_tokens)
            return self._qa

    def prepare(self, engine: EngineLike, question: str, *, answer_tokens: int,
                history: Sequence[dict], chat_system: str = "", **policy) -> Prepared:
        """The prompt of ``question`` about the set (see `DocumentQA.prepare`; ``policy``:
        its ``policy`` and ``summary``)."""
        qa = self.qa_for(engine)
        # the chat's system prompt joins the Q&A rules; the same text keeps the prefix
        qa.system = document_system(chat_system)
        return qa.prepare(question, answer_tokens=answer_tokens, history=list(history),
                          **policy)


def tokens_text(n: int | None) -> str:
    """A token count for the eye; None: no model has counted them yet."""
    return "tokens counted when a model is loaded" if n is None else f"{n:,} tokens"


def prefix_text(prepared: Prepared, stats) -> str:
    """Whether this answer found the document's prefix in the KV cache, and where."""
    prefix = prepared.prefix_tokens
    cached = getattr(stats, "cached_tokens", 0)
    source = getattr(stats, "cache_source", "none")
    if cached and source != "none":
        return f"prefix {min(cached, prefix):,}/{prefix:,} tokens from cache ({source})"
    return f"prefix {prefix:,} tokens prefilled, cached for the next question"


def answer_line(attached: AttachedDocuments, prepared: Prepared, stats) -> str:
    """The document line under an answer: what went in, what was left out, cache, budget."""
    b = prepared.budget
    parts = [prepared.report(attached.docs)]
    if prepared.prefix_tokens and stats is not None:
        parts.append(prefix_text(prepared, stats))
    parts.append(f"budget {b.documents:,} of {b.total:,} tokens for documents")
    return " · ".join(parts)


def bar_text(attached: AttachedDocuments, last: tuple[Prepared, object] | None) -> str:
    """The document bar: the documents, their size and, after an answer, how it went."""
    parts = [attached.names, tokens_text(attached.total_tokens)]
    if last is None:
        parts.append("sent with every question")
    else:
        prepared, stats = last
        p = prepared.placement
        if p.mode == "whole":
            parts.append("whole")
            if stats is not None:
                parts.append(prefix_text(prepared, stats))
        else:
            parts.append(f"{len(p.selected)} chunks, {p.left_out_tokens:,} tokens left out")
        parts.append(f"budget {prepared.budget.documents:,}/{prepared.budget.total:,}")
    parts.append("/doc off detaches")
    return " · ".join(parts)
