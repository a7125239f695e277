"""Log-probabilities in OpenAI's shapes: chat's ``logprobs.content`` and the legacy
completions' ``tokens`` / ``token_logprobs`` / ``top_logprobs`` / ``text_offset``.

The figures come from the engine (`engine.logprobs`: the model's raw log-softmax). Each
token is shown as its text and its UTF-8 bytes, read from the tokenizer's vocabulary (a
token may hold part of a character: its ``bytes`` are exact, its text has U+FFFD there).
End-of-sequence tokens are not listed, as OpenAI does not list its own.
"""

from __future__ import annotations

import re
from functools import lru_cache

from engine.logprobs import TokenLogprob

_SPM_BYTE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
_TABLES: dict[int, TokenText] = {}


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    from mlx_lm.tokenizer_utils import _byte_decoder as table

    return table()


class TokenText:
    """Token id -> (text, UTF-8 bytes), per the tokenizer's kind of vocabulary."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.eos = frozenset(getattr(tokenizer, "eos_token_ids", ()) or ())
        kind = type(getattr(tokenizer, "detokenizer", None)).__name__
        self.kind = "bpe" if "BPE" in kind else "spm" if "SPM" in kind else "text"
        self._cache: dict[int, tuple[str, list[int]]] = {}

    @classmethod
    def of(cls, tokenizer) -> TokenText:
        """The one table of ``tokenizer`` (a server has one model)."""
        found = _TABLES.get(id(tokenizer))
        if found is None or found.tokenizer is not tokenizer:
            found = _TABLES[id(tokenizer)] = cls(tokenizer)
        return found

    def __call__(self, token: int) -> tuple[str, list[int]]:
        found = self._cache.get(token)
        if found is None:
            raw = self._bytes(token)
            found = self._cache[token] = (raw.decode("utf-8", errors="replace"), list(raw))
        return found

    def _bytes(self, token: int) -> bytes:
        if self.kind != "text":
            piece = self.tokenizer.convert_ids_to_tokens(token)
            if isinstance(piece, str):
                if self.kind == "bpe":
                    table = _byte_decoder()
                    if all(c in table for c in piece):
                        return bytes(table[c] for c in piece)
                else:
                    m = _SPM_BYTE.match(piece)
                    return bytes([int(m.group(1), 16)]) if m else piece.replace(
                        "\u2581", " ").encode()
        return self.tokenizer.decode([token]).encode()

    def shown(self, lps: list[TokenLogprob]) -> list[TokenLogprob]:
        """The logprobs a response lists (no end-of-sequence token)."""
        return [lp for lp in lps if lp.token not in self.eos]


def chat_content(text_of: TokenText, lps: list[TokenLogprob]) -> list[dict]:
    """``choices[].logprobs.content`` entries."""
    def entry(token: int, logprob: float) -> dict:
        text, raw = text_of(token)
        return {"token": text, "logprob": logprob, "bytes": raw}

    return [{**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
            for lp in text_of.shown(lps)]


class LegacyLogprobs:
    """The legacy completions' logprobs object, its ``text_offset`` running on across the
    chunks of a stream (offsets are characters into the completion's text)."""

    def __init__(self, text_of: TokenText):
        self.text_of = text_of
        self.offset = 0

    def __call__(self, lps: list[TokenLogprob]) -> dict:
        out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for lp in self.text_of.shown(lps):
            text, _ = self.text_of(lp.token)
            out["tokens"].append(text)
            out["token_logprobs"].append(lp.logprob)
            top: dict[str, float] = {}
            for t, v in lp.top:  # two ids may show as the same text: keep the likelier
                top.setdefault(self.text_of(t)[0], v)
            out["top_logprobs"].append(top)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out
