"""Token counts of long texts, a slice at a time: memory bounded by the slice, not the text.

A tokenizer given a whole document builds, for every token, its string, offsets and
masks, and for every byte an alignment: ~135 MB per MB of text, held at once (a 20 MB
file took `kvchat ask` to 5.3 GB, issue 33 item 3). Counted in slices of `SLICE_CHARS`
cut just before a space that follows a non-space (where byte-level BPE pre-tokenizers
split anyway), the sum is the whole text's count for those tokenizers and within a
token per slice for others; and it is faster (no alignment tracking of megabytes).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

SLICE_CHARS = 1 << 16  # ~16k tokens of text per tokenizer call


def slices(text: str, size: int = SLICE_CHARS) -> Iterator[str]:
    """``text`` in consecutive pieces of at most ``size`` characters, each (but the last)
    ending where a space follows a non-space character when there is one in its second
    half (else cut at ``size``: a word split in two, a token or so off)."""
    start, end = 0, len(text)
    while start < end:
        stop = min(end, start + size)
        if stop < end:
            cut = text.rfind(" ", start + size // 2, stop)
            while cut > start + size // 2 and text[cut - 1].isspace():
                cut = text.rfind(" ", start + size // 2, cut)
            if cut > start + size // 2:
                stop = cut
        yield text[start:stop]
        start = stop


def sliced_counter(count: Callable[[str], int],
                   size: int = SLICE_CHARS) -> Callable[[str], int]:
    """``count`` for any text: texts longer than ``size`` are counted slice by slice."""

    def bounded(text: str) -> int:
        if len(text) <= size:
            return count(text)
        return sum(count(part) for part in slices(text, size))

    return bounded
