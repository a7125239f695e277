"""Independent benchmark prompts: every length and every repeat gets text of its own.

A prompt cut from the same text as another shares its leading blocks, so a prefix
cache (kvchat's, or a peer's) would serve them and the "prefill" measured would be a
cache hit. Here the source is a pool of 40-line chunks of stdlib modules, shuffled with
a seeded RNG; each prompt takes fresh chunks in turn and no chunk is used twice, so no
two prompts share text. The result is deterministic for a given seed, Python version
and tokenizer, and `first_block_clashes` proves the property on the token ids.

Only the standard library at import: this module never loads the engine.
"""

from __future__ import annotations

import importlib.util
import random
from collections.abc import Iterable, Iterator

# Large pure-Python stdlib modules, read as files (never imported): ~2 MB of text,
# ~500k tokens, far more than any length x repeats a context window allows.
SOURCE_MODULES = (
    "argparse", "textwrap", "difflib", "inspect", "dataclasses", "typing", "configparser",
    "calendar", "pydoc", "tarfile", "smtplib", "ftplib", "imaplib", "subprocess", "threading",
    "shutil", "tempfile", "enum", "statistics", "fractions", "_pydecimal", "http.client",
    "urllib.request", "email.message", "logging", "unittest.case", "ast", "pickle",
)
CHUNK_LINES = 40  # well under the tokenizer's max length once encoded
DEFAULT_SEED = 0


def source_chunks(seed: int = DEFAULT_SEED) -> list[str]:
    """All distinct 40-line chunks of `SOURCE_MODULES`, in a seeded random order."""
    chunks: dict[str, None] = {}  # a dict keeps the first occurrence's order, deduplicated
    for name in SOURCE_MODULES:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            continue  # a trimmed Python install: the rest of the pool is still plenty
        with open(spec.origin, encoding="utf-8") as f:
            lines = f.read().splitlines(keepends=True)
        for start in range(0, len(lines), CHUNK_LINES):
            text = "".join(lines[start:start + CHUNK_LINES])
            if text.strip():
                chunks[text] = None
    pool = list(chunks)
    random.Random(seed).shuffle(pool)
    return pool


def _encode(tokenizer, text: str) -> list[int]:
    # No BOS or other special tokens: nothing the tokenizer adds can be a shared prefix.
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    return list(hf.encode(text, add_special_tokens=False))


def first_block_clashes(prompts: Iterable[list[int]], block_size: int) -> list[tuple[int, int]]:
    """Index pairs ``(i, j)`` of prompts whose first ``block_size`` tokens are equal.

    A prompt shorter than one block has no full block to share and never clashes.
    """
    seen: dict[tuple[int, ...], int] = {}
    clashes = []
    for j, ids in enumerate(prompts):
        if len(ids) < block_size:
            continue
        head = tuple(ids[:block_size])
        if head in seen:
            clashes.append((seen[head], j))
        else:
            seen[head] = j
    return clashes


class PromptSource:
    """Hands out prompts of exact lengths, each from chunks no other prompt used."""

    def __init__(self, tokenizer, *, block_size: int, seed: int = DEFAULT_SEED):
        self._tokenizer = tokenizer
        self._block_size = block_size
        self._chunks: Iterator[str] = iter(source_chunks(seed))
        self._heads: set[tuple[int, ...]] = set()

    def take(self, length: int) -> list[int]:
        """Token ids of exactly ``length``, sharing no text and no first block with earlier ones.

        Raises:
            RuntimeError: when the pool runs out (lengths x repeats beyond ~500k tokens).
        """
        while True:
            ids: list[int] = []
            while len(ids) < length:
                chunk = next(self._chunks, None)
                if chunk is None:
                    raise RuntimeError(f"the benchmark's prompt pool ran out at a {length}-token "
                                       "prompt: use fewer lengths or repeats")
                ids += _encode(self._tokenizer, chunk)
            ids = ids[:length]  # the rest of the last chunk is dropped, never reused
            head = tuple(ids[:self._block_size])
            # Distinct chunks can still open alike (e.g. two runs of blank lines): such a
            # prompt is dropped and rebuilt from the next chunks.
            if len(ids) < self._block_size or head not in self._heads:
                self._heads.add(head)
                return ids


def cold_prompts(tokenizer, lengths: list[int], repeats: int, *, block_size: int,
                 warmup_tokens: int, seed: int = DEFAULT_SEED,
                 ) -> tuple[list[int], dict[int, list[list[int]]]]:
    """A warm-up prompt and ``{length: [ids of repeat 0, repeat 1, ...]}``, all independent."""
    source = PromptSource(tokenizer, block_size=block_size, seed=seed)
    warmup = source.take(warmup_tokens)
    return warmup, {n: [source.take(n) for _ in range(repeats)] for n in lengths}
