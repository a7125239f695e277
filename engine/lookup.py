"""Prompt lookup's index: where each n-gram of a sequence's tokens last ended, so drafts
can copy what followed the latest earlier occurrence of the sequence's suffix."""

from __future__ import annotations

from collections.abc import Sequence


class LookupIndex:
    """Where each n-gram of a token list last ended, kept up to date as tokens are added."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.last_end: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # n-grams ending before this position are in ``last_end``

    def propose(self, ids: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the longest
        suffix n-gram of ``ids`` (none if no suffix of ``min_n`` tokens occurred)."""
        end = len(ids) - 1
        if end > self.indexed:
            self._index(ids, end)
        if k <= 0:
            return []
        for n in range(min(self.max_n, len(ids)), self.min_n - 1, -1):
            e = self.last_end.get(tuple(ids[len(ids) - n:]))
            if e is not None:
                return ids[e + 1:e + 1 + k]
        return []

    def _index(self, ids: Sequence[int], end: int) -> None:
        """Every n-gram ending at positions indexed..end-1 (the later end kept), n by n
        with the tuples built in C: a 2k-token prompt's first call took ~4 ms of Python
        loops, in the first decode step, where a plain engine has no such work."""
        for n in range(self.min_n, self.max_n + 1):
            lo = max(self.indexed, n - 1)  # the first end with n tokens before it
            if lo < end:
                grams = zip(*(ids[lo - n + 1 + j:end - n + 1 + j] for j in range(n)), strict=True)
                self.last_end.update(zip(grams, range(lo, end), strict=True))
        self.indexed = end
