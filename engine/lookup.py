"""Prompt lookup's index: where each n-gram of a sequence's tokens last ended, so drafts
can copy what followed the latest earlier occurrence of the sequence's suffix."""

from __future__ import annotations


class LookupIndex:
    """Where each n-gram of a token list last ended, kept up to date as tokens are added."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.last_end: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # n-grams ending before this position are in ``last_end``

    def propose(self, ids: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the longest
        suffix n-gram of ``ids`` (none if no suffix of ``min_n`` tokens occurred)."""
        end = len(ids) - 1
        for e in range(self.indexed, end):  # every n-gram ending before the last token
            for n in range(self.min_n, min(self.max_n, e + 1) + 1):
                self.last_end[tuple(ids[e - n + 1:e + 1])] = e
        self.indexed = max(self.indexed, end)
        if k <= 0:
            return []
        for n in range(min(self.max_n, len(ids)), self.min_n - 1, -1):
            e = self.last_end.get(tuple(ids[len(ids) - n:]))
            if e is not None:
                return ids[e + 1:e + 1 + k]
        return []
