"""Catching an answer that loops: the same piece of text written over and over to max tokens.

A small model decoding greedily falls into such loops on everyday questions ("Boil an egg:"
forty times; a poem's line until the token limit). The chat stops the answer once its end
has repeated one piece three times over at least `MIN_LOOP_CHARS` characters, and keeps the
text up to the first copy of the piece.
"""

from __future__ import annotations

MIN_PERIOD, MAX_PERIOD = 8, 400  # characters of the repeated piece
MIN_LOOP_CHARS = 200
MIN_REPEATS = 3


def loop_cut(text: str) -> int | None:
    """Where to cut ``text`` to keep one copy of a piece its end repeats; None: no loop.

    The end has period p when ``text[n-3p:n-p] == text[n-2p:n]`` (whatever the phase the
    text stops at); the loop starts where that periodicity begins.
    """
    n = len(text)
    for p in range(MIN_PERIOD, min(MAX_PERIOD, n // MIN_REPEATS) + 1):
        if text[n - 3 * p:n - p] != text[n - 2 * p:]:
            continue
        start = n - 3 * p
        while start > 0 and text[start - 1] == text[start - 1 + p]:
            start -= 1
        if n - start >= MIN_LOOP_CHARS:
            return start + p
    return None
