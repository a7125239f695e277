"""Speculative decoding: draft tokens by prompt lookup, and how many to verify per sequence.

A decoding sequence may feed, besides its last token, ``k`` draft tokens guessed from
n-grams that already occurred in its prompt or answer (prompt lookup: document Q&A
copies spans of the document). The step verifies them in the same batched forward as
every other sequence's decode (`engine.verify`): one forward yields up to ``k + 1``
tokens. How many drafts a sequence gets is decided per step from what was measured: each
sequence's recent acceptance rate, and what a plain step of this batch size and each
verified token on top of it cost (`SpecCost`); a draft token is added only while its
expected yield per second beats the step's (so in a large batch, where every extra token costs as
much as a whole sequence's decode, speculation switches itself off).
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from engine.config import SpecConfig
from engine.draft_model import DraftModel
from engine.kvcache.block_manager import BlockManager
from engine.lookup import LookupIndex
from engine.metrics import MetricsRecorder
from engine.model.loader import LoadedModel, load_model
from engine.pacing import StepPacer, ema
from engine.request import Request
from engine.spec_cost import SpecCost
from engine.token_classes import BREAK, JOIN, OTHER, START, TokenClasses, in_context

PROBE_EVERY = 8  # steps between one-draft probes while drafts are measured not to pay
# EMA weight of a draft's outcome in the acceptance rates: the latest outcomes weigh most
# (copying comes in runs); with the draft classes judging breaks apart, 0.6 replayed best
# of 0.1-0.9 (0.15 did before the classes: a lone hit in a paraphrase restarted drafting)
ACCEPT_WEIGHT = 0.6


@dataclass(slots=True)
class SpecState:
    """One sequence's speculation: its lookup index and its measured acceptance."""

    index: LookupIndex | None
    accept_rate: float  # EMA of how often a step's first draft held
    # EMA of how often a draft held once the one before it had: a copied span goes on, so
    # later drafts hold far more often than first ones (not the first rate's powers)
    follow_rate: float = 0.5


@dataclass(slots=True)
class Speculator:
    """Proposes each decoding sequence's drafts for the next step."""

    config: SpecConfig
    cost: SpecCost
    recorder: MetricsRecorder | None = None  # engine-wide spec_proposed / spec_accepted
    draft: DraftModel | None = None  # mode "draft": who proposes
    idle_steps: int = 0  # steps since drafts were last verified
    states: dict[int, SpecState] = field(default_factory=dict)
    prior: float = 0.5  # first-draft acceptance of a sequence not yet measured (engine-wide)
    prior_follow: float = 0.5  # the same for the drafts after a held one
    # the first draft of a sequence that verifies none this step: checked against the
    # token it gets, so a sequence's rate keeps being measured while it does not speculate
    shadow: dict[int, int] = field(default_factory=dict)
    # the draft after a sequence's last verified one: if all of them hold, the step's own token
    # says whether it would have too (else a low follow rate is never tried again)
    shadow_next: dict[int, int] = field(default_factory=dict)
    # each draft's class (`engine.token_classes`; None: all OTHER): a JOIN's, a BREAK's or a
    # START's odds are the engine-wide rate of its class, not the sequence's own rates
    classes: TokenClasses | None = None
    class_rates: dict[int, float] = field(default_factory=lambda: {JOIN: .9, BREAK: .3, START: .3})
    # per sequence: the class of each draft it verifies and of its `shadow_next` or `shadow`
    after: dict[int, list[int]] = field(default_factory=dict)

    @property
    def active(self) -> bool:
        return self.config.mode != "off"

    # steps drafted after 27-35 % of two draft-free steps in the replay, 64 % after one
    quiet = property(lambda self: self.active and self.idle_steps >= 2)

    def plan(self, decoding: list[tuple[int, Sequence[int], int]], queued: bool = True,
             fresh: Collection[int] = ()) -> dict[int, list[int]]:
        """Drafts for sequences given as (id, all token ids, tokens it may still produce after
        the next one), none for those left out. ``queued``: requests wait for a place in the
        batch (see `_allot`); ``fresh``: sequences with no output yet (a START first draft)."""
        for kept in (self.shadow, self.shadow_next, self.after):
            kept.clear()
        if not self.active or not decoding:
            return {}
        c = self.config
        for seq, _, _ in decoding:
            if seq not in self.states:
                self.states[seq] = SpecState(
                    LookupIndex(c.min_ngram, c.max_ngram) if self.draft is None else None,
                    self.prior, self.prior_follow)
        if self.draft is not None:
            return self._plan_draft(decoding)
        cands: dict[int, list[int]] = {}
        for seq, ids, room in decoding:
            draft = self.states[seq].index.propose(ids, min(c.max_draft, room))
            if draft:
                cands[seq] = draft
        last = {seq: ids[-1] for seq, ids, _ in decoding}
        # each draft's class, from the token before it (the first's: the sequence's last)
        kinds = {s: [OTHER if self.classes is None else self.classes(b, t)
                     for b, t in zip([last[s], *d[:-1]], d, strict=True)]
                 for s, d in cands.items()}
        for s in kinds.keys() & fresh:
            kinds[s][0] = START
        drafts = ({s: d[:c.fixed] for s, d in cands.items()} if c.fixed
                  else self._allot(cands, kinds, len(decoding), queued))
        self.shadow = {s: d[0] for s, d in cands.items() if s not in drafts}
        self.shadow_next = {s: cands[s][len(d)] for s, d in drafts.items()
                            if len(d) < len(cands[s])}
        self.after = {s: k[:len(drafts.get(s, ())) + 1] for s, k in kinds.items()}
        return drafts

    def _odds(self, st: SpecState, kind: int, first: bool) -> float:
        """How likely a draft of class ``kind`` holds once the drafts before it did: its
        class's rate for a JOIN, a BREAK or a START, else the sequence's own."""
        if kind != OTHER:
            return self.class_rates[kind]
        return st.accept_rate if first else st.follow_rate

    def _allot(self, cands: dict[int, list[int]], kinds: dict[int, list[int]], rows: int,
               queued: bool) -> dict[int, list[int]]:
        """Keep the draft tokens whose expected worth beats their cost.

        Draft i of a sequence is accepted with probability ~ the product of the odds
        (`_odds`) of it and each draft before it (all must hold; a span once matched tends
        to go on, so the first draft's odds differ from the later ones'); a step's yield is its
        rows plus the accepted drafts, its cost fixed + per-token x tokens. Greedily add the
        draft with the highest acceptance while its expected tokens are worth its cost: with
        requests queued, a token is worth the step's seconds per token (drafts pay while they
        raise its tokens per second: a sequence that ends sooner lets the next one in);
        with none, a batch runs until its longest answer ends, and a token that ends a
        shorter one sooner saves only its row in a later step (`SpecCost.row`; one
        sequence alone: its steps per second, as queued)."""
        fit = self.cost.fit(rows)
        if not cands or fit is None:  # unmeasured: a plain step measures what it costs
            return {}
        seconds, per = fit
        tokens, row = float(rows), None if queued else self.cost.row(rows)
        heap = [(-self._odds(self.states[s], kinds[s][0], True), s, 1) for s in cands]
        heapq.heapify(heap)
        taken: dict[int, int] = {}
        while heap:
            neg_p, s, i = heapq.heappop(heap)
            p = -neg_p
            if p * (seconds / tokens if row is None else row) <= per:
                break
            tokens, seconds = tokens + p, seconds + per
            taken[s] = i
            if i < len(cands[s]):
                heapq.heappush(heap, (-(p * self._odds(self.states[s], kinds[s][i], False)),
                                      s, i + 1))
        self.idle_steps = 0 if taken else self.idle_steps + 1
        if not taken and self.idle_steps % PROBE_EVERY == 0:  # keep the cost measured
            s = max(cands, key=lambda s: self.states[s].accept_rate)
            taken[s] = 1
        return {s: cands[s][:n] for s, n in taken.items()}

    def _plan_draft(self, decoding: list[tuple[int, Sequence[int], int]]) -> dict[int, list[int]]:
        """One draft length for the batch (the draft model decodes the sequences together):
        the k whose expected tokens per second, draft forwards included, is highest."""
        ready = [(s, ids, room) for s, ids, room in decoding if room > 0]
        fit, ds = self.cost.fit(len(decoding)), self.draft.step_s
        if not ready:
            return {}
        best = self.config.fixed or 1  # unmeasured: one draft each measures both costs
        if fit is not None and ds is not None and not self.config.fixed:
            rates = [(self.states[s].accept_rate, self.states[s].follow_rate)
                     for s, _, _ in ready]
            fixed, per = fit

            def rate(k: int) -> float:
                tokens = len(decoding) + sum(sum(r * f ** (i - 1) for i in range(1, k + 1))
                                             for r, f in rates)
                return tokens / (fixed + k * (per * len(ready) + ds))

            best = max(range(self.config.max_draft + 1), key=rate)
        self.idle_steps = 0 if best else self.idle_steps + 1
        if not best and self.idle_steps % PROBE_EVERY:
            return {}
        drafts = self.draft.propose([(s, ids) for s, ids, _ in ready], max(best, 1))
        rooms = {s: room for s, _, room in ready}
        return {s: d[:rooms[s]] for s, d in drafts.items() if d}

    def observe(self, seq: int, tried: int, accepted: int, after: int | None = None) -> None:
        """``accepted`` of ``tried`` drafts of ``seq`` held (or would have); drafts are
        tried in order up to the first that fails. ``after``: the token that followed when
        all of them held, checked against the unverified draft after them (`shadow_next`).
        A JOIN, a BREAK or a START draft counts for its class's rate alone."""
        st = self.states.get(seq)
        if st is None or tried == 0:
            return
        held = [j < accepted for j in range(tried)]
        guess, before = self.shadow_next.pop(seq, None), self.after.pop(seq, [])
        if accepted == tried and after is not None and guess is not None:
            held.append(guess == after)
        follow = []
        for j, h in enumerate(held):
            k = before[j] if j < len(before) else OTHER
            if k != OTHER:
                self.class_rates[k] = ema(self.class_rates[k], float(h), ACCEPT_WEIGHT)
            elif j == 0:
                st.accept_rate = ema(st.accept_rate, float(h), ACCEPT_WEIGHT)
                self.prior = ema(self.prior, float(h), ACCEPT_WEIGHT)
            else:
                follow.append(h)
        if follow:  # the drafts after a held first one
            rate = sum(follow) / len(follow)
            st.follow_rate = ema(st.follow_rate, rate, ACCEPT_WEIGHT)
            self.prior_follow = ema(self.prior_follow, rate, ACCEPT_WEIGHT)

    def forget(self, seq: int) -> SpecState | None:
        """Drop a finished sequence's state (and its draft-model blocks); returns it."""
        if self.draft is not None:
            self.draft.forget(seq)
        return self.states.pop(seq, None)

    def assign(self, running: list[Request], queued: bool = True) -> None:
        """Set the drafts each running request verifies in the next step (none for one that
        prefills, or whose grammar or logits processors would have to follow the drafts);
        ``queued``: requests wait for a place in the batch."""
        ready = [r for r in running if not r.in_prefill and r.decoder.speculable
                 and not r.num_dropped]  # a context-shifted sequence decodes one at a time
        drafts = self.plan([(r.request_id, r.ids_view,
                             r.max_new - r.stats.generation_tokens - 1) for r in ready],
                           queued, {r.request_id for r in ready if not r.output_ids})
        for r in running:
            r.draft = drafts.get(r.request_id, [])
            end = next((i for i, t in enumerate(r.draft) if t in r.decoder.eos), None)
            if end is not None:  # nothing after an end token is ever used
                r.draft = r.draft[:end + 1]
            g = r.decoder.grammar
            if r.draft and g is not None:  # only what the grammar takes can be verified
                r.draft = r.draft[:g.accepts(r.draft)]
            if end is not None or len(r.draft) < len(drafts.get(r.request_id, ())):
                self.shadow_next.pop(r.request_id, None)  # cut, or nothing after its end

    def judge(self, seq: int, draft: Sequence[int], accepted: int, after: int | None) -> None:
        """A step of ``seq`` verified ``draft`` (maybe none), ``accepted`` of them held, and
        its own token was ``after`` (None: not known): the rates learn from it (and from
        the unverified `shadow` guess of a step without drafts)."""
        guess = self.shadow.pop(seq, None)
        if not draft:
            if guess is not None and after is not None:
                self.observe(seq, 1, int(guess == after))
            return
        # drafts after the first rejected one were never tried: the rate is per tried draft
        self.observe(seq, accepted + (accepted < len(draft)), accepted, after)

    def settle(self, req: Request, tokens: list[int]) -> None:
        """A step of ``req`` gave ``tokens``: its drafts that held, then one of its own."""
        accepted = len(tokens) - 1
        self.judge(req.request_id, req.draft, accepted, tokens[-1])
        if not req.draft:
            return
        s = req.stats
        s.spec_proposed += len(req.draft)
        s.spec_accepted += accepted
        if self.recorder is not None:
            self.recorder.spec_proposed += len(req.draft)
            self.recorder.spec_accepted += accepted
        req.draft = []


def build_speculator(speculate: str, pacer: StepPacer, recorder: MetricsRecorder | None,
                     blocks: BlockManager, vocab_size: int, notices: list[str],
                     target: LoadedModel, draft: LoadedModel | None = None) -> Speculator:
    """The engine's speculator for `EngineConfig.speculate` ("off", "lookup" or
    "draft:MODEL") and the ``target`` model, its costs measured against ``pacer``'s; off,
    with a notice, where the pool cannot give slots back. Lookup's drafts are classed by
    the target's tokenizer's text of them (`engine.token_classes`)."""
    mode, _, name = speculate.partition(":")
    if mode != "off" and blocks.window is not None:
        notices.append("speculative decoding is off: the model has sliding-window layers")
        mode = "off"
    drafter = classes = None
    if mode == "draft":
        drafter = DraftModel(draft or load_model(name), num_blocks=blocks.num_blocks,
                             block_size=blocks.block_size, vocab_size=vocab_size)
    elif mode == "lookup":
        classes = TokenClasses(in_context(target.tokenizer))
    return Speculator(SpecConfig(mode), SpecCost(pacer), recorder, drafter, classes=classes)
