"""Documents for Q&A: plain text, Markdown and PDF files, read and checked.

PDF text comes from `pypdf` (pure Python, no system libraries, actively maintained, and
it keeps page boundaries, which the answer's "left out" report names). A PDF without a
text layer (a scan) is refused: kvchat does no OCR. Binary, undecodable and empty files
are refused with one line that says why.
"""

from __future__ import annotations

import hashlib
import io
from bisect import bisect_right
from dataclasses import dataclass
from pathlib import Path

from app.arg_types import read_file_bytes
from engine.errors import KVChatError

MAX_DOCUMENT_BYTES = 64 << 20  # far beyond any context; bounds memory for a stray huge file
TEXT_SUFFIXES = {".md": "markdown", ".markdown": "markdown"}


class DocumentError(KVChatError):
    """A file that cannot be used as a document (one line, meant for the user)."""


@dataclass(frozen=True, slots=True)
class Document:
    """A document's text, where it came from, and its content hash (the cache's identity)."""

    name: str
    kind: str  # "text", "markdown", "pdf" or "paste"
    text: str
    sha256: str
    path: str | None = None
    page_starts: tuple[int, ...] = ()  # PDF: the character offset where each page starts

    def page_at(self, offset: int) -> int | None:
        """The 1-based page holding character ``offset`` (None for non-PDF documents)."""
        return bisect_right(self.page_starts, offset) if self.page_starts else None


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def document_from_text(text: str, name: str = "paste") -> Document:
    """A pasted text as a document; raises DocumentError if it is empty."""
    text = _clean(text)
    if not text.strip():
        raise DocumentError(f"{name}: the document is empty")
    return Document(name, "paste", text, _digest(text))


def _clean(text: str) -> str:
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _decode_text(path: str, data: bytes) -> str:
    if b"\x00" in data[:8192] and not data.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise DocumentError(f"{path} is a binary file, not text")
    for encoding in ("utf-8-sig", "utf-16"):
        if encoding == "utf-16" and not data.startswith((b"\xff\xfe", b"\xfe\xff")):
            continue
        try:
            return data.decode(encoding)
        except UnicodeDecodeError:
            pass
    raise DocumentError(f"{path} is not UTF-8 text (binary, or another encoding)")


def _pdf_pages(path: str, data: bytes) -> list[str]:
    from pypdf import PdfReader
    from pypdf.errors import LimitReachedError, PyPdfError

    try:
        reader = PdfReader(io.BytesIO(data))
        if reader.is_encrypted:
            raise DocumentError(f"{path} is an encrypted PDF; decrypt it first")
        return [page.extract_text() or "" for page in reader.pages]
    except DocumentError:
        raise
    except LimitReachedError:  # pypdf's own bound on decompressed bytes
        raise DocumentError(f"{path}: a compressed stream in the PDF expands past pypdf's "
                            "limit (a decompression bomb?); not read") from None
    except (PyPdfError, ValueError, KeyError, TypeError, OSError, RecursionError) as e:
        raise DocumentError(f"{path} is not a readable PDF: {e}") from None


def load_document(path: str | Path) -> Document:
    """Read ``path`` as a document (``.pdf`` by content, anything else as UTF-8 text).

    Raises:
        DocumentError: missing, unreadable, binary, undecodable or empty file, or a PDF
            without a text layer.
    """
    path = str(path)
    try:
        data = read_file_bytes(path, MAX_DOCUMENT_BYTES)
    except ValueError as e:
        raise DocumentError(str(e)) from None
    name = Path(path).name
    if data.startswith(b"%PDF-"):
        pages = [_clean(p) for p in _pdf_pages(path, data)]
        if not any(p.strip() for p in pages):
            raise DocumentError(f"{path}: the PDF has no text layer (a scan?); "
                                "run OCR on it first")
        starts, offset = [], 0
        for page in pages:
            starts.append(offset)
            offset += len(page) + 2  # joined by a blank line below
        text = "\n\n".join(pages)
        return Document(name, "pdf", text, _digest(text), path, tuple(starts))
    text = _clean(_decode_text(path, data))
    if not text.strip():
        raise DocumentError(f"{path} is empty")
    kind = TEXT_SUFFIXES.get(Path(path).suffix.lower(), "text")
    return Document(name, kind, text, _digest(text), path)
