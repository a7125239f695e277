"""Chunks ranked by relevance to a question: BM25 through `bm25s`.

`bm25s` is maintained, needs only numpy, indexes tens of thousands of chunks in
milliseconds, and ships English stopwords; lexical BM25 suits needle-style questions
that repeat the document's own words, and needs no embedding model (nothing to download).
"""

from __future__ import annotations

from collections.abc import Sequence

from app.documents.chunks import Chunk


def rank(chunks: Sequence[Chunk], question: str) -> list[tuple[int, float]]:
    """(chunk position, score) for every chunk, best first; ties keep document order."""
    if not chunks:
        return []
    import bm25s

    corpus = bm25s.tokenize([c.text for c in chunks], stopwords="en", show_progress=False)
    retriever = bm25s.BM25()
    retriever.index(corpus, show_progress=False)
    query = bm25s.tokenize([question], stopwords="en", show_progress=False)
    if not any(len(ids) for ids in query.ids):  # only stopwords: nothing to score by
        return [(i, 0.0) for i in range(len(chunks))]
    ids, scores = retriever.retrieve(query, k=len(chunks), show_progress=False)
    ranked = [(int(i), float(s)) for i, s in zip(ids[0], scores[0], strict=True)]
    return sorted(ranked, key=lambda r: (-r[1], r[0]))
