"""One request's decoding state: sampler, logits processors, detokenizer, stop strings.

Built once per request at `submit`, so a bad parameter fails that request at the door;
afterwards it turns sampled token ids into streamed text and decides when the request
ends (EOS, a stop string, its token budget).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

import mlx.core as mx

from engine.constraint import GrammarMatcher
from engine.sampling import SamplingParams
from engine.thinking import ThinkBudget
from engine.verify import accepted_sampled

Sampler = Callable[[mx.array], mx.array]
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


class StopMatcher:
    """Finds stop strings in streamed text without emitting a partial match."""

    def __init__(self, stops: list[str]):
        self.stops = list(stops)
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.pending = ""
        self.matched: str | None = None  # the stop string that ended the text, if one did

    def feed(self, segment: str) -> tuple[str, bool]:
        """Add text; return (text safe to emit, whether a stop string was hit)."""
        self.pending += segment
        hits = [(i, s) for i, s in ((self.pending.find(s), s) for s in self.stops) if i >= 0]
        if hits:
            at, self.matched = min(hits, key=lambda h: h[0])
            out, self.pending = self.pending[:at], ""
            return out, True
        cut = len(self.pending) - self.hold
        if cut <= 0:
            return "", False
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


@dataclass(slots=True)
class Accepted:
    """What one accepted token produced: text to stream, and the finish reason if it ended."""

    text: str
    finish: str | None = None


class Decoder:
    """Samples a request's tokens and turns them into text; decides when it ends."""

    def __init__(self, params: SamplingParams, detokenizer, eos_ids: Collection[int],
                 max_new: int, grammar: GrammarMatcher | None = None,
                 think: ThinkBudget | None = None):
        self.params = params
        self.grammar = grammar  # the output's constraint (`engine.constraint`), if any
        self.think = think  # the thinking budget (`engine.thinking`), if any
        self.max_new = max_new
        self.sampler: Sampler = params.make_sampler()
        self.processors: list[LogitsProcessor] = params.make_logits_processors()
        self.detok = detokenizer
        self.stop = StopMatcher(params.stop)
        self.eos = frozenset() if params.ignore_eos else frozenset(eos_ids)
        self._seeded = params.seed is None

    @property
    def greedy(self) -> bool:
        """Argmax of the logits suffices: no temperature, processors, grammar, logprobs
        or thinking budget still counting (its tokens may be launched unread)."""
        return (self.argmax and self.grammar is None and self.params.logprobs is None
                and self.think_settled)

    @property
    def argmax(self) -> bool:
        """The token is the argmax of the logits (after the grammar's mask, if any)."""
        return (self.params.temperature == 0 and not self.processors
                and (self.think is None or self.think.next_forced is None))

    @property
    def think_settled(self) -> bool:
        """No thinking budget, or its thought is over: no token will be forced."""
        return self.think is None or self.think.done

    @property
    def speculable(self) -> bool:
        """Drafts can be verified for it: no logits processors (penalties, whose history
        would have to follow each draft token) and no thinking budget still counting; a
        grammar masks each verify row."""
        return not self.processors and self.think_settled

    def _seed(self) -> None:
        if not self._seeded:  # seeded on the first sample, inside the request's own try
            mx.random.seed(self.params.seed)
            self._seeded = True

    def sample_drafts(self, logits: mx.array, draft: list[int]) -> list[int]:
        """The tokens a sampled step yields from ``len(draft) + 1`` rows of logits (the
        rejection rule of `engine.verify`: the output distribution is unchanged)."""
        self._seed()
        return accepted_sampled(self.params, draft, logits)

    def sample(self, logits: mx.array, history: list[int]) -> int:
        """One token from a (1, vocab) row of logits (or the one a thinking budget forces)."""
        if self.think is not None and self.think.next_forced is not None:
            return self.think.next_forced
        self._seed()
        if self.processors:
            ids = mx.array(history, dtype=mx.int32)
            for proc in self.processors:
                logits = proc(ids, logits)
        if self.grammar is not None:
            logits = self.grammar.apply(logits)
        logits = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return int(self.sampler(logits).item())

    def accept(self, token: int, generated: int) -> Accepted:
        """The text ``token`` releases; ``generated`` counts it (1 for the first token)."""
        if self.grammar is not None:
            self.grammar.consume(token)
        if token in self.eos:
            return self._final("", "stop", eos=True)
        self.detok.add_token(token)
        segment = self.detok.last_segment  # reading it consumes it
        if self.think is not None and not self.think.done:
            self.think.feed(token, segment)
        text, hit = self.stop.feed(segment)
        if hit or (self.grammar is not None and self.grammar.stopped):
            return self._final(text, "stop")
        if generated >= self.max_new:
            return self._final(text, "length")
        return Accepted(text)

    def _final(self, text: str, finish: str, *, eos: bool = False) -> Accepted:
        if self.grammar is not None:
            self.grammar.close()
        self.detok.finalize()
        if finish == "length" or eos:
            # bytes the detokenizer held back may still complete a stop string
            more, hit = self.stop.feed(self.detok.last_segment)
            text += more if hit else more + self.stop.flush()
            finish = "stop" if hit else finish
        return Accepted(text, finish)
