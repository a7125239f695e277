"""The context budget of one question, and what of the documents goes into it.

A context window is a ceiling, not a quota. The budget is the smallest of the model's
context and the free KV pool, less the answer, the question, the template and the
conversation kept. Documents that fit go in whole, first (a pinned prefix whose blocks
every later question reuses). Otherwise they are cut into chunks; the chunks BM25 ranks
highest for the question (those within a share of the best score; all of them, best first,
for documents that nearly fit) go in, up to the budget,
in document order with their positions shown, and everything else is reported as left
out. Nothing is ever cut silently.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from app.documents.chunks import Chunk
from app.documents.load import Document
from app.documents.retrieval import rank

HISTORY_SHARE = 4  # earlier turns may take at most 1/4 of the budget; the oldest go first
RELEVANT_SHARE = 0.2  # retrieval keeps chunks scoring at least this share of the best one
NEAR_FIT = 1.1  # documents at most this much over the budget fill it, in order of relevance


@dataclass(frozen=True, slots=True)
class Budget:
    """Token budget of one question (all counts in tokens)."""

    context: int  # one sequence's limit (prompt + answer)
    free_kv: int  # tokens the KV pool can hold now (free and evictable blocks)
    answer: int  # reserved for the answer
    fixed: int  # system text, template, question and the turns kept
    prompt: int | None = None  # the prompt's ceiling (`app.documents.budgets`); None: none
    source: str = ""  # where ``prompt`` came from

    @property
    def total(self) -> int:
        return min(self.context, self.free_kv)

    @property
    def documents(self) -> int:
        """What the documents may take."""
        room = self.total - self.answer
        if self.prompt is not None:
            room = min(room, self.prompt)
        return max(0, room - self.fixed)

    def to_dict(self) -> dict:
        return {"context": self.context, "free_kv": self.free_kv, "answer": self.answer,
                "fixed": self.fixed, "total": self.total, "documents": self.documents,
                "prompt": self.prompt, "source": self.source}


@dataclass(slots=True)
class Placement:
    """The documents' text as placed in the prompt, and what was left out."""

    mode: str  # "whole" or "retrieval"
    text: str
    tokens: int  # of ``text``
    selected: list[Chunk] = field(default_factory=list)  # retrieval only
    left_out: list[Chunk] = field(default_factory=list)

    @property
    def left_out_tokens(self) -> int:
        return sum(c.tokens for c in self.left_out)

    def summary(self, docs: Sequence[Document]) -> str:
        """One line: what was placed and, always, what was left out."""
        if self.mode == "whole":
            return f"documents placed whole ({self.tokens} tokens); nothing left out"
        parts = []
        for i, doc in enumerate(docs):
            out = [c for c in self.left_out if c.doc == i]
            if out:
                pages = sorted({c.page for c in out if c.page is not None})
                where = f", pages {_ranges(pages)}" if pages else ""
                parts.append(f"{doc.name}: {len(out)} chunks ({sum(c.tokens for c in out)} "
                             f"tokens{where})")
        return (f"retrieval: {len(self.selected)} chunks most relevant to the question "
                f"({self.tokens} tokens); left out " + ("; ".join(parts) or "nothing"))

    def to_dict(self) -> dict:
        def row(c: Chunk) -> dict:
            return {"doc": c.doc, "chunk": c.index, "start_token": c.start_token,
                    "tokens": c.tokens, "start_char": c.start_char, "page": c.page}

        return {"mode": self.mode, "tokens": self.tokens,
                "selected": [row(c) for c in self.selected],
                "left_out": [row(c) for c in self.left_out],
                "left_out_tokens": self.left_out_tokens}


def _ranges(numbers: list[int]) -> str:
    out, start = [], None
    for i, n in enumerate(numbers):
        start = n if start is None else start
        if i + 1 == len(numbers) or numbers[i + 1] != n + 1:
            out.append(f"{start}" if start == n else f"{start}-{n}")
            start = None
    return ", ".join(out)


def render_whole(docs: Sequence[Document]) -> str:
    return "\n\n".join(f'<document name="{d.name}">\n{d.text}\n</document>' for d in docs)


def render_chunks(docs: Sequence[Document], chunks: Sequence[Chunk],
                  all_chunks: Sequence[Chunk]) -> str:
    """Selected chunks in document order, each headed by its position; gaps are marked."""
    lines: list[str] = []
    for i, doc in enumerate(docs):
        mine = sorted((c for c in chunks if c.doc == i), key=lambda c: c.index)
        total = sum(1 for c in all_chunks if c.doc == i)
        if not mine:
            lines.append(f'<document name="{doc.name}">[no chunk selected]</document>')
            continue
        body, last = [], -1
        for c in mine:
            if c.index > last + 1:
                body.append(f"[... {c.index - last - 1} chunks left out ...]")
            body.append(f"[{c.label()}]\n{c.text}")
            last = c.index
        if last + 1 < total:
            body.append(f"[... {total - last - 1} chunks left out ...]")
        lines.append(f'<document name="{doc.name}" chunks="{total}">\n'
                     + "\n\n".join(body) + "\n</document>")
    return "\n\n".join(lines)


def place(docs: Sequence[Document], chunks: Callable[[], list[Chunk]], question: str,
          budget: int, count: Callable[[str], int], *, at_least: int = 0) -> Placement:
    """Whole documents if they fit ``budget`` tokens, else the most relevant chunks.

    ``chunks`` is called only when retrieval is needed (cutting costs tokenizer time);
    ``at_least`` bounds the whole documents' tokens from below (their own counts): past
    the budget, the whole is neither rendered nor counted again (seconds per MB of text).
    """
    whole_tokens = None
    if at_least <= budget:
        whole = render_whole(docs)
        n = count(whole)
        if n <= budget:
            return Placement("whole", whole, n)
        whole_tokens = n
    every = chunks()
    ranked = rank(every, question)
    best = ranked[0][1] if ranked else 0.0
    near = whole_tokens is not None and whole_tokens <= NEAR_FIT * budget
    if near:
        # Nearly fits: only the least relevant chunks stay out (cutting it to the relevant
        # share would leave most of what the budget holds unused).
        order = [every[i] for i, _ in ranked]
    elif best > 0:
        # Only what is relevant: a filled window adds noise and cost (the budget is a
        # ceiling).
        order = [every[i] for i, s in ranked if s >= RELEVANT_SHARE * best]
    else:  # no word of the question in any chunk: the document's start is all there is
        order = list(every)
    chosen: list[Chunk] = []
    used = 0
    for c in order:  # headers cost tokens too: keep a margin, then check the real count
        if used + c.tokens + 24 <= budget:
            chosen.append(c)
            used += c.tokens + 24
    text = render_chunks(docs, chosen, every)
    n = count(text)
    while chosen and n > budget:
        chosen.pop()  # the least relevant of those chosen
        text = render_chunks(docs, chosen, every)
        n = count(text)
    if near:  # the margin above is generous: fill what it left, checking the real count
        for c in [c for c in order if c not in chosen]:
            more = render_chunks(docs, chosen + [c], every)
            m = count(more)
            if m <= budget:
                chosen, text, n = chosen + [c], more, m
    picked = {(c.doc, c.index) for c in chosen}
    left = [c for c in every if (c.doc, c.index) not in picked]
    chosen.sort(key=lambda c: (c.doc, c.index))
    return Placement("retrieval", text, n, chosen, left)
