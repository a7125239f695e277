"""Draft classes for speculation's odds: what kind of token a draft is, and follows.

How likely a lookup draft holds depends on the tokens around it far more than on the
sequence alone (on `kvchat bench spec`'s answers and 15 held-out ones): a draft that goes
on the word or number of the token before it (a subword piece, the next digit) held
238 times of 239; one that follows a sentence's end or a punctuation mark 0-28 % (an
answer quotes a sentence, then stops or goes its own way where the document goes on);
others 62-92 %. The speculator keeps an engine-wide acceptance rate for the first two
classes and each sequence's own rates for the rest (`engine.speculation`).
"""

from __future__ import annotations

import unicodedata
from collections.abc import Callable

OTHER, JOIN, BREAK = 0, 1, 2
# not a token's class but a draft's place: a sequence's first draft, guessed from its prompt
# alone (a chat prompt ends in the answer's header, which lookup goes on with as the template
# goes on elsewhere: held 0 of 25 times on `kvchat bench spec`'s and 15 held-out prompts)
START = 3
ENDS = frozenset(".!?")


def features(text: str) -> tuple[bool, bool, bool]:
    """(starts glued: its first character is a letter or digit; ends in one; is a break:
    a line break, ending in . ! ?, or punctuation only) of a token's text (a partial
    UTF-8 character's U+FFFD is none of these)."""
    core = text.strip()
    brk = "\n" in text or bool(core) and (core[-1] in ENDS or all(
        unicodedata.category(ch).startswith("P") for ch in core))
    return text[:1].isalnum(), text[-1:].isalnum(), brk


def in_context(tokenizer) -> Callable[[int], str]:
    """A token id -> its text after a word (so a SentencePiece word's leading space, which
    decoding the token alone drops, is kept) by ``tokenizer`` (`decode`, `encode`)."""
    try:
        anchor = list(tokenizer.encode("a", add_special_tokens=False))[-1:]
        base = tokenizer.decode(anchor)
    except Exception:  # noqa: BLE001 - a tokenizer without these: each token's text alone
        anchor, base = [], ""
    return lambda token: tokenizer.decode([*anchor, token])[len(base):]


class TokenClasses:
    """A draft's class from the tokenizer's text of it and of the token before it."""

    def __init__(self, text: Callable[[int], str]):
        self.text = text
        self.known: dict[int, tuple[bool, bool, bool]] = {}

    def _features(self, token: int) -> tuple[bool, bool, bool]:
        f = self.known.get(token)
        if f is None:
            try:
                f = features(self.text(token))
            except Exception:  # noqa: BLE001 - an id the tokenizer cannot decode
                f = (False, False, False)
            self.known[token] = f
        return f

    def __call__(self, before: int, token: int) -> int:
        """JOIN (``token`` goes on the word or number ``before`` ends in), BREAK (``before``
        ends a sentence or is punctuation), else OTHER."""
        b = self._features(before)
        if b[1] and self._features(token)[0]:
            return JOIN
        return BREAK if b[2] else OTHER
