"""Constrained decoding: a request's output held to a JSON schema, any JSON object, a regex
or a Lark grammar, token by token.

The grammar engine is llguidance (chosen by measurement, `scripts/bench_grammar_engines.py`:
4.7 us mean / 9.9 us p99 per mask at a 49k vocabulary and the best tail at 151k, against
xgrammar, which needs torch, and outlines-core, whose free-JSON mode takes seconds to build
and rejects nested JSON; it has rollback for speculative drafts). Each request owns one
`GrammarMatcher`: the mask of allowed tokens is applied to its logits before sampling, the
sampled token advances it, and the next mask is computed on a worker thread (llguidance
releases the GIL) while the next forward runs. A preempted request keeps its matcher, as it
keeps its output tokens; finishing or cancelling drops it.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Collection
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from engine.errors import RequestError

KINDS = ("json_schema", "json_object", "regex", "grammar")
MAX_CONSTRAINT_CHARS = 256_000  # a schema or grammar larger than this is refused at the door
# Compact JSON: flexible whitespace lets a small model emit newlines until max_tokens.
JSON_OPTIONS = {"whitespace_flexible": False}

_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvchat-grammar")


@dataclass(frozen=True, slots=True)
class Constraint:
    """What a request's output must match.

    Attributes:
        kind (str): one of `KINDS`.
        value (str): the JSON schema (as JSON text), the regex, or the Lark grammar
            (llama.cpp's GBNF is accepted too); empty for ``json_object``.
    """

    kind: str
    value: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise RequestError(f"constraint kind must be one of {', '.join(KINDS)}, "
                               f"got {self.kind!r:.40}")
        if not isinstance(self.value, str) or len(self.value) > MAX_CONSTRAINT_CHARS:
            raise RequestError(f"a {self.kind} must be text of at most "
                               f"{MAX_CONSTRAINT_CHARS:,} characters")
        if self.kind != "json_object" and not self.value.strip():
            raise RequestError(f"the {self.kind} is empty")

    @classmethod
    def json_schema(cls, schema) -> Constraint:
        """From a schema as a dict (or bool) or as JSON text."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise RequestError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise RequestError("a JSON schema must be an object (or true/false)")
        try:
            text = json.dumps(schema, allow_nan=False)
        except (ValueError, TypeError, RecursionError) as e:
            raise RequestError(f"the JSON schema cannot be encoded: {e}") from None
        return cls("json_schema", text)


def grammar_of(c: Constraint) -> str:
    """llguidance's grammar text for a constraint (unchecked: `Grammars.check` checks)."""
    from llguidance import LLMatcher

    if c.kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
    if c.kind == "json_schema":
        return LLMatcher.grammar_from_json_schema(c.value, overrides=JSON_OPTIONS)
    if c.kind == "regex":
        return LLMatcher.grammar_from_regex(c.value)
    text = c.value
    if "::=" in text:  # GBNF (llama.cpp's grammars) rather than Lark
        from llguidance.gbnf_to_lark import gbnf_to_lark

        try:
            text = gbnf_to_lark(text)
        except Exception as e:  # noqa: BLE001 - the converter's own errors, any type
            raise RequestError(f"the GBNF grammar cannot be read: {e}") from None
    return LLMatcher.grammar_from_lark(text)


def one_line(message: str, limit: int = 300) -> str:
    """llguidance's multi-line diagnostics (a caret under the grammar) as one line."""
    return " ".join(message.split())[:limit]


class Grammars:
    """One model's grammar compiler: its tokenizer as llguidance sees it (built on first
    use, ~0.3 s at 49k tokens) and the last grammars it checked."""

    CACHE = 64

    def __init__(self, hf_tokenizer, eos_ids: Collection[int], vocab_size: int):
        self._hf = hf_tokenizer
        self._eos = sorted(eos_ids)
        self.vocab_size = vocab_size
        self._ll = None
        self._checked: OrderedDict[Constraint, str] = OrderedDict()
        self._lock = threading.Lock()

    def _tokenizer(self):
        if self._ll is None:
            import llguidance.hf

            self._ll = llguidance.hf.from_tokenizer(self._hf, eos_token=self._eos or None)
        return self._ll

    def check(self, c: Constraint) -> str:
        """The constraint's grammar, compiled once; a `RequestError` naming what is wrong."""
        from llguidance import LLMatcher

        with self._lock:
            if c in self._checked:
                self._checked.move_to_end(c)
                return self._checked[c]
            try:
                grammar = grammar_of(c)
            except ValueError as e:
                raise RequestError(f"invalid {c.kind}: {one_line(str(e))}") from None
            failed, messages = LLMatcher.validate_grammar_with_warnings(grammar,
                                                                        self._tokenizer())
            if failed:
                raise RequestError(f"invalid {c.kind}: {one_line(messages[0])}")
            self._checked[c] = grammar
            if len(self._checked) > self.CACHE:
                self._checked.popitem(last=False)
            return grammar

    def matcher(self, c: Constraint) -> GrammarMatcher:
        """A fresh matcher for one request (raises `RequestError` for a bad constraint)."""
        from llguidance import LLMatcher

        grammar = self.check(c)
        m = LLMatcher(self._tokenizer(), grammar, log_level=0)
        if m.is_error():
            raise RequestError(f"invalid {c.kind}: {one_line(m.get_error())}")
        return GrammarMatcher(m, self.vocab_size)


def mask_rows(logits: mx.array, grammars: list[GrammarMatcher | None]
              ) -> tuple[mx.array, dict[int, Exception]]:
    """(rows, vocab) logits with each row's forbidden tokens at -inf (a None grammar
    forbids nothing), as one op; and the rows whose matcher failed, by index."""
    allowed = np.ones((len(grammars), logits.shape[-1]), dtype=bool)
    failed: dict[int, Exception] = {}
    for j, g in enumerate(grammars):
        if g is not None:
            try:
                allowed[j] = g.allowed()[: logits.shape[-1]]
            except Exception as e:  # noqa: BLE001 - that request fails, alone
                failed[j] = e
    return mx.where(mx.array(allowed), logits, forbidden(logits.dtype)), failed


def forbidden(dtype: mx.Dtype) -> mx.array:
    """A forbidden token's logit: the dtype's lowest finite value, not -inf, so a masked
    row stays finite and keeps the CPU extension's fast greedy pick (`engine.greedy`);
    no real logit comes near it, so the argmax and the sampled distribution are as with
    -inf."""
    return mx.array(mx.finfo(dtype).min, dtype=dtype)


class GrammarMatcher:
    """One request's place in its grammar: the mask of allowed next tokens, and the
    tokens it has accepted."""

    def __init__(self, matcher, vocab_size: int):
        self._m = matcher
        self.vocab_size = vocab_size
        self._next: Future | None = _pool.submit(matcher.compute_bitmask)

    @property
    def stopped(self) -> bool:
        """The grammar is complete and admits nothing more (EOS is all it allows)."""
        return self._m.is_stopped()

    def allowed(self) -> np.ndarray:
        """(vocab_size,) bool: the tokens the grammar admits next."""
        bits = (self._next.result() if self._next is not None else self._m.compute_bitmask())
        self._next = None
        return self._unpack(bits)

    def draft_masks(self, draft: list[int]) -> np.ndarray:
        """(len(draft) + 1, vocab_size) bool: what the grammar admits before each draft token
        and after the last (speculative decoding's verify rows); the state does not move.
        ``draft`` must be one the grammar takes (`accepts`)."""
        rows = [self.allowed()]
        taken = 0
        try:
            for t in draft:
                if not self._m.consume_token(t):
                    raise RuntimeError(f"draft token {t} is outside the grammar")
                taken += 1
                rows.append(self._unpack(self._m.compute_bitmask()))
        finally:
            if taken:
                self._m.rollback(taken)
        return np.stack(rows)

    def _unpack(self, bits) -> np.ndarray:
        if self._m.is_error():
            raise RuntimeError(f"grammar matcher failed: {self._m.get_error()[:200]}")
        mask = np.unpackbits(np.frombuffer(bits, dtype=np.uint8), bitorder="little")
        out = np.zeros(self.vocab_size, dtype=bool)
        n = min(self.vocab_size, mask.size)
        out[:n] = mask[:n]  # tokens past the tokenizer's (padded embedding rows): never
        return out

    def apply(self, logits: mx.array) -> mx.array:
        """``logits`` (1, vocab) with every token the grammar forbids at -inf."""
        allowed = mx.array(self.allowed()[: logits.shape[-1]])
        return mx.where(allowed, logits, forbidden(logits.dtype))

    def accepts(self, tokens: list[int]) -> int:
        """How many of ``tokens``, in order, the grammar admits from here (a draft's
        check; the state does not move)."""
        self._settle()
        return self._m.validate_tokens(tokens)

    def _settle(self) -> None:
        # the matcher is not shared with the worker: wait for the mask it computes
        if self._next is not None:
            self._next.result()

    def consume(self, token: int) -> None:
        """Advance by the sampled token and start computing the next mask."""
        if not self._m.consume_token(token):
            raise RuntimeError(f"token {token} is outside the grammar: "
                               f"{self._m.get_error()[:200]}")
        self._next = None if self._m.is_stopped() else _pool.submit(self._m.compute_bitmask)

    def close(self) -> None:
        """Drop the pending mask (the matcher goes with the request)."""
        if self._next is not None and not self._next.cancel():
            self._next.result()  # running: let it finish with the matcher
        self._next = None
