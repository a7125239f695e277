"""Draft classes: a draft that goes on the word before it, one after a sentence's end or
punctuation, and the rest; read from the real tokenizer's text of each token."""

from __future__ import annotations

import pytest

from engine.token_classes import BREAK, JOIN, OTHER, TokenClasses, features, in_context


@pytest.mark.parametrize(("text", "want"), [
    ("ony", (True, True, False)),  # a word's piece: starts and ends glued
    (" Antony", (False, True, False)),
    ("7", (True, True, False)),
    (".", (False, False, True)),
    (" said.", (False, False, True)),  # ends a sentence
    ("\n", (False, False, True)),
    (' "', (False, False, True)),  # punctuation only
    (" ", (False, False, False)),
    ("\ufffd", (False, False, False)),  # part of a UTF-8 character: none of these
    ("中", (True, True, False)),
])
def test_features_of_a_tokens_text(text, want):
    assert features(text) == want


def test_classes_from_the_default_tokenizer(default_model):
    tok = default_model.tokenizer
    text = in_context(tok)
    ids = tok.encode('Antony paid 4521 coins. Then, "no" he said\n', add_special_tokens=False)
    pieces = [text(t) for t in ids]
    assert "".join(pieces) == tok.decode(ids)  # each token's text, its leading space kept
    classes = TokenClasses(text)
    got = {(pieces[i - 1], pieces[i]): classes(ids[i - 1], ids[i]) for i in range(1, len(ids))}
    assert got[("Ant", "ony")] == JOIN  # the word goes on
    assert got[("4", "5")] == got[("2", "1")] == JOIN  # the number goes on
    assert got[(".", " Then")] == got[(",", ' "')] == got[("\"", " he")] == BREAK
    assert got[("ony", " paid")] == got[(" paid", " ")] == got[(" coins", ".")] == OTHER
    assert classes(10**9, ids[0]) == OTHER  # an id the tokenizer cannot decode


def test_a_tokenizer_that_cannot_encode_falls_back_to_each_tokens_text():
    class Plain:
        def encode(self, text):  # no add_special_tokens: the anchor cannot be had
            return [1]

        def decode(self, ids):
            return "".join({1: "Ant", 2: "ony", 3: "."}[i] for i in ids)

    classes = TokenClasses(in_context(Plain()))
    assert classes(1, 2) == JOIN and classes(3, 1) == BREAK and classes(2, 3) == OTHER
