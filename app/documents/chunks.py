"""Documents cut into chunks of about a fixed token size, each with its position.

Cuts fall on paragraph boundaries, then sentence boundaries, then words, so a chunk
is readable on its own; a chunk remembers its document, its character and token
offsets and (for PDFs) its page, so an answer can say exactly what it left out.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from app.documents.load import Document

DEFAULT_CHUNK_TOKENS = 256
_PARAGRAPH = re.compile(r"\n\s*\n")
_SENTENCE = re.compile(r"(?<=[.!?])\s+")


@dataclass(frozen=True, slots=True)
class Chunk:
    """One piece of one document."""

    doc: int  # index of the document among those asked about
    index: int  # position among the document's chunks
    text: str
    start_char: int
    start_token: int  # tokens of the document before it (piece counts, approximate)
    tokens: int
    page: int | None = None

    def label(self) -> str:
        where = f"page {self.page}, " if self.page is not None else ""
        return f"chunk {self.index + 1} ({where}tokens {self.start_token}-" \
               f"{self.start_token + self.tokens})"


def _pieces(text: str, start: int, pattern: re.Pattern) -> list[tuple[int, str]]:
    out, pos = [], 0
    for m in pattern.finditer(text):
        if text[pos:m.start()].strip():
            out.append((start + pos, text[pos:m.start()]))
        pos = m.end()
    if text[pos:].strip():
        out.append((start + pos, text[pos:]))
    return out


def _split_long(offset: int, text: str, limit: int,
                count: Callable[[str], int]) -> list[tuple[int, str, int]]:
    """(offset, text, tokens) pieces of at most ~``limit`` tokens: sentences, then words."""
    n = count(text)
    if n <= limit:
        return [(offset, text, n)]
    sentences = _pieces(text, offset, _SENTENCE)
    if len(sentences) > 1:
        return [p for o, s in sentences for p in _split_long(o, s, limit, count)]
    words = text.split(" ")
    step = max(1, len(words) * limit // n)
    out, pos = [], 0
    for i in range(0, len(words), step):
        part = " ".join(words[i:i + step])
        out.append((offset + pos, part, count(part)))
        pos += len(part) + 1
    return out


def split_document(doc: Document, doc_index: int, count: Callable[[str], int],
                   chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> list[Chunk]:
    """``doc`` as consecutive chunks of at most about ``chunk_tokens`` tokens."""
    pieces = [p for o, t in _pieces(doc.text, 0, _PARAGRAPH)
              for p in _split_long(o, t, chunk_tokens, count)]
    chunks: list[Chunk] = []
    group: list[tuple[int, str, int]] = []
    start_token = 0

    def close() -> None:
        nonlocal start_token
        if not group:
            return
        first = group[0][0]
        last_offset, last_text, _ = group[-1]
        text = doc.text[first:last_offset + len(last_text)]
        tokens = sum(n for _, _, n in group)
        chunks.append(Chunk(doc_index, len(chunks), text, first, start_token, tokens,
                            doc.page_at(first)))
        start_token += tokens
        group.clear()

    for piece in pieces:
        if group and sum(n for _, _, n in group) + piece[2] > chunk_tokens:
            close()
        group.append(piece)
    close()
    return chunks
