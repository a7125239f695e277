"""A long document's memory is bounded by a slice, not by the document (issue 33 item 3).

`kvchat ask` on 2 / 5 / 10 / 20 MB of plain text peaked at 1.75 / 2.3 / 3.3 / 5.3 GB: the
whole text went through the tokenizer at once (~135 MB per MB of text, tokens, offsets and
byte alignments), twice (its count, then the rendered prompt's). Now no tokenizer call sees
more than `counting.SLICE_CHARS` characters, and a document past the budget is never
rendered whole. Peak RSS per size is measured by hand (see the issue's closing note), not
asserted here; what is asserted is the shape: the longest text any count gets.
"""

from __future__ import annotations

import random

from test_tui_fakes import FakeEngine

from app.documents.chunks import split_document
from app.documents.counting import SLICE_CHARS, sliced_counter, slices
from app.documents.load import document_from_text, load_document
from app.documents.policy import place
from app.documents.qa import DocumentQA
from engine.prompts import plain_ids

WORDS = ["the", "lighthouse", "keeper", "wrote", "of", "storms", "ships", "and", "gulls", "in",
         "a", "small", "blue", "book", "every", "evening", "after", "lamp", "was", "lit"]


def plain_text(num_chars: int, seed: int = 0) -> str:
    """Sentences in paragraphs, and, as in real files, some runs of spaces and newlines."""
    rng = random.Random(seed)
    out, n = [], 0
    while n < num_chars:
        s = " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 20))).capitalize() + "."
        s += rng.choice([" ", " ", " ", "  ", "\n", "\n\n", " \n\n  "])
        out.append(s)
        n += len(s)
    return "".join(out)


class CountingEngine(FakeEngine):
    """Records the longest text handed to `count_tokens`."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.longest = 0

    def count_tokens(self, text):
        self.longest = max(self.longest, len(text))
        return super().count_tokens(text)


def test_slices_cover_the_text_and_cut_before_a_word():
    text = plain_text(300_000)
    parts = list(slices(text, 4096))
    assert "".join(parts) == text and len(parts) > 70
    assert all(len(p) <= 4096 for p in parts)
    for a, b in zip(parts, parts[1:], strict=False):
        assert b[0] == " " and not a[-1].isspace()  # a word's own leading space starts b
    unbroken = "x" * 10_000  # no space at all: cut at the size
    assert [len(p) for p in slices(unbroken, 4096)] == [4096, 4096, 1808]


def test_a_sliced_count_is_the_whole_count(default_model):
    # byte-level BPE splits before " word" anyway: the sum is exact for such tokenizers
    tok = default_model.tokenizer
    text = plain_text(3 * SLICE_CHARS + 1234, seed=1)
    count = sliced_counter(lambda s: len(plain_ids(tok, s)))
    assert count(text) == len(plain_ids(tok, text))


def test_a_long_document_is_never_tokenized_whole(tmp_path):
    path = tmp_path / "long.txt"
    path.write_text(plain_text(2 << 20))  # 2 MB on disk, loaded as a user's file is
    doc = load_document(path)
    engine = CountingEngine(max_prompt_tokens=4096)
    qa = DocumentQA(engine, [doc])
    assert qa.total_tokens == len(doc.text.split())  # the count itself is unchanged
    prepared = qa.prepare("What did the keeper write of gulls?", answer_tokens=64)
    assert prepared.placement.mode == "retrieval" and prepared.placement.selected
    assert engine.longest <= SLICE_CHARS  # was the whole 2 MB, then the rendered 2 MB


def test_a_document_known_too_long_is_not_rendered_whole():
    doc = document_from_text(plain_text(20_000))
    seen = []

    def count(text):
        seen.append(len(text))
        return len(text.split())

    chunks = split_document(doc, 0, count, 64)
    seen.clear()
    p = place([doc], lambda: chunks, "gulls?", 200, count, at_least=len(doc.text.split()))
    assert p.mode == "retrieval"
    assert max(seen) < len(doc.text)  # only the chosen chunks' text was counted
