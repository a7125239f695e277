"""Speculative decoding's parts: prompt lookup, the measured draft allotment, giving slots
back, and the sampling rule (its output distribution is the plain sampler's)."""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.kvcache.block_manager import BlockManager
from engine.lookup import LookupIndex
from engine.pacing import StepPacer
from engine.sampling import SamplingParams
from engine.spec_cost import SpecCost
from engine.speculation import ACCEPT_WEIGHT as W
from engine.speculation import SpecConfig, Speculator
from engine.token_classes import BREAK, JOIN, OTHER, START, TokenClasses
from engine.verify import accepted_greedy, accepted_sampled, rows, target_logits


def test_lookup_takes_the_latest_longest_match():
    idx = LookupIndex(2, 3)
    ids = [1, 2, 3, 9, 1, 2, 4, 7, 5, 1, 2]
    # suffix (1, 2): last seen ending at 5 -> continues 4, 7, 5
    assert idx.propose(ids, 2) == [4, 7]
    # a longer suffix wins over a later, shorter one: (4, 1, 2)? no; (5, 1, 2)? no
    ids2 = [8, 1, 2, 6, 6, 8, 1, 2, 3, 3, 8, 1, 2]
    assert LookupIndex(2, 3).propose(ids2, 3) == [3, 3, 8]  # (8, 1, 2) last ended at 7
    assert LookupIndex(2, 3).propose([5, 6, 7, 8], 4) == []  # nothing repeats
    assert idx.propose(ids, 0) == []


@given(st.lists(st.integers(0, 4), min_size=1, max_size=60), st.integers(1, 6))
@settings(max_examples=150, deadline=None)
def test_lookup_incremental_equals_fresh(ids, k):
    """Growing one index token by token proposes what a fresh index proposes."""
    grown = LookupIndex(1, 3)
    for n in range(1, len(ids) + 1):
        got = grown.propose(ids[:n], k)
        assert got == LookupIndex(1, 3).propose(ids[:n], k)
        if got:  # a real continuation of an earlier occurrence of the suffix
            assert len(got) <= k
            text = ids[:n]
            assert any(text[e + 1:e + 1 + len(got)] == got and text[e] == text[-1]
                       for e in range(n - 1))


@given(st.lists(st.integers(0, 3), min_size=1, max_size=80), st.integers(1, 4),
       st.integers(0, 3), st.integers(1, 5))
@settings(max_examples=200, deadline=None)
def test_lookup_matches_a_search_of_the_text(ids, min_n, extra, k):
    """The proposal is what follows the latest earlier end of the longest suffix n-gram
    (min_n..max_n tokens), found by searching the text itself; grown in two calls alike."""
    max_n = min_n + extra
    expect = []
    for n in range(min(max_n, len(ids)), min_n - 1, -1):
        ends = [e for e in range(n - 1, len(ids) - 1) if ids[e - n + 1:e + 1] == ids[-n:]]
        if ends:
            expect = ids[ends[-1] + 1:ends[-1] + 1 + k]
            break
    assert LookupIndex(min_n, max_n).propose(ids, k) == expect
    split = LookupIndex(min_n, max_n)
    split.propose(ids[:len(ids) // 2 + 1], k)
    assert split.propose(ids, k) == expect


def speculator(fixed, per):
    """A lookup speculator whose cost has seen decode steps costing fixed + per x tokens."""
    sp = Speculator(SpecConfig("lookup", max_draft=4, min_ngram=1), SpecCost(StepPacer(4)))
    sp.cost.warmup = 0
    if fixed is not None:
        for rows, drafts in ((1, 0), (2, 0), (8, 0), (16, 0), (1, 4)):
            sp.cost.observe(rows, drafts, fixed + per * (rows + drafts))
    return sp


def copying(n=3):
    """A sequence whose suffix repeats: lookup has 4 tokens to offer."""
    return [1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6, 1, 2][:12 + n]


def test_allotment_follows_measured_cost_and_acceptance():
    sp = speculator(0.020, 0.002)
    sp.prior = sp.prior_follow = 0.9
    assert sp.plan([(0, copying(), 10)]) == {0: [3, 4, 5, 6]}  # cheap and likely: all 4
    dear = speculator(0.020, 0.3)  # a token costs 15 steps' fixed part
    dear.prior = dear.prior_follow = 0.9
    assert dear.plan([(0, copying(), 10)]) == {}
    assert dear.shadow == {0: 3}  # still measured against the token the step gives
    # at batch 16 the step's own tokens are worth more than a 60 % guess
    big = speculator(0.040, 0.004)
    assert big.cost.fit(16) == pytest.approx((0.040 + 16 * 0.004, 0.004))
    big.prior = big.prior_follow = 0.6
    assert big.plan([(s, copying(), 10) for s in range(16)]) == {}
    assert big.plan([(0, copying(), 10)])[0][:1] == [3]
    # room left caps the drafts; unmeasured cost proposes nothing
    assert sp.plan([(1, copying(), 2)]) == {1: [3, 4]}
    # unmeasured: a plain step first, which measures what it costs
    assert speculator(None, None).plan([(0, copying(), 10)]) == {}


def test_with_nothing_queued_a_draft_is_worth_the_row_it_saves():
    """A closed batch runs until its longest answer ends: a draft that ends another one
    sooner saves only that sequence's row in a later step, so with nothing queued a draft
    that pays in a queued batch's tokens per second does not; alone, it still pays."""
    sp = speculator(0.040, 0.004)  # a row and a draft token cost 4 ms each
    assert sp.cost.row(8) == pytest.approx(0.004) and sp.cost.row(1) is None
    sp.prior = sp.prior_follow = 0.9
    batch = [(s, copying(), 10) for s in range(8)]
    assert sp.plan(batch, queued=True)  # 0.9 of a token at 72 ms / 8 beats 4 ms
    assert sp.plan(batch, queued=False) == {}  # 0.9 of a 4 ms row does not
    assert sp.plan([(0, copying(), 10)], queued=False) == sp.plan([(0, copying(), 10)])
    assert sp.plan([(0, copying(), 10)])
    only_big = SpecCost(StepPacer(4), warmup=0)
    only_big.observe(8, 0, 0.050)
    assert only_big.row(8) is None  # no smaller batch measured: as if queued


def test_shadow_measurement_turns_speculation_back_on():
    sp = speculator(0.020, 0.016)  # a draft pays at a rate above 0.016 / 0.036
    sp.prior = 0.1
    assert sp.plan([(0, copying(), 10)]) == {}
    for steps in range(1, 9):  # noqa: B007 - the unverified guesses keep coming true
        sp.observe(0, 1, int(sp.shadow.pop(0) == 3))
        drafts = sp.plan([(0, copying(), 10)])
        if drafts:
            break
    assert drafts[0][0] == 3 and sp.states[0].accept_rate > 0.016 / 0.036


def test_the_draft_after_the_verified_ones_is_measured_too():
    """When every verified draft held, the step's own token says whether the next (not
    verified) draft would have: a follow rate measured low rises again, so more than one
    draft a step can come back (it was never tried while only one paid)."""
    sp = speculator(0.020, 0.004)
    sp.prior, sp.prior_follow = 0.9, 0.1
    assert sp.plan([(0, copying(), 10)]) == {0: [3]}
    assert sp.shadow_next == {0: 4}
    for steps in range(1, 12):  # noqa: B007 - the guess past the draft keeps coming true
        sp.observe(0, 1, 1, after=4)
        drafts = sp.plan([(0, copying(), 10)])[0]
        if len(drafts) > 1:
            break
    assert drafts[:2] == [3, 4]
    n, before = len(drafts), sp.states[0].follow_rate
    assert sp.shadow_next[0] == copying()[2 + n]
    sp.observe(0, n, n, after=-1)  # all held, the token after did not: n - 1 of n held
    assert sp.states[0].follow_rate == pytest.approx(before + W * ((n - 1) / n - before))
    sp.plan([(0, copying(), 10)])
    before = sp.states[0].follow_rate
    sp.observe(0, 1, 0, after=4)  # the first draft failed: nothing is learnt past it
    assert sp.states[0].follow_rate == before


def test_draft_classes_steer_the_allotment_and_learn_apart():
    """A draft after a break (a sentence's end) takes the engine-wide break rate as its
    odds, one that goes on the word before it the join rate, the rest the sequence's own
    rates; each outcome teaches only the rate it was judged by."""
    sp = speculator(0.020, 0.004)
    # lookup offers 3, 4, 5, 6 after 2: "b" -> "." (other), "." -> " c" (a break),
    # " c" -> "d" and "d" -> "e" (joins)
    sp.classes = TokenClasses({1: " a", 2: "b", 3: ".", 4: " c", 5: "d", 6: "e"}.get)
    sp.prior, sp.prior_follow = 0.9, 0.1
    sp.class_rates = {JOIN: 0.99, BREAK: 0.95}
    assert sp.plan([(0, copying(), 10)]) == {0: [3, 4, 5, 6]}  # follow 0.1 never asked
    assert sp.after[0] == [OTHER, BREAK, JOIN, JOIN]
    sp.observe(0, 2, 1)  # the draft after the break failed
    assert sp.class_rates[BREAK] == pytest.approx(0.95 * (1 - W))
    assert sp.states[0].follow_rate == 0.1 and sp.class_rates[JOIN] == 0.99
    assert sp.states[0].accept_rate == pytest.approx(0.9 + W * 0.1)
    sp.class_rates[BREAK] = 0.05
    assert sp.plan([(0, copying(), 10)]) == {0: [3]}  # nothing past the sentence's end
    assert sp.shadow_next == {0: 4} and sp.after[0] == [OTHER, BREAK]
    sp.observe(0, 1, 1, after=4)  # the step's own token went past the break after all
    assert sp.class_rates[BREAK] == pytest.approx(0.05 + W * 0.95)
    assert sp.states[0].follow_rate == 0.1


def test_a_first_draft_from_the_prompt_alone_learns_its_own_rate():
    """A sequence with no output yet guesses its first token from the prompt alone (a chat
    prompt's end: the answer's header): that draft is a START, judged by the engine-wide
    START rate and teaching only it; its later drafts and every other step are as before."""
    sp = speculator(0.020, 0.004)
    sp.prior = sp.prior_follow = 0.9
    sp.class_rates[START] = 0.05
    assert sp.plan([(0, copying(), 10), (1, copying(), 10)], fresh={0}) == {1: [3, 4, 5, 6]}
    assert sp.shadow == {0: 3} and sp.after[0] == [START]
    sp.observe(0, 1, 1)  # it would have held (a multi-turn chat repeating its opening)
    assert sp.class_rates[START] == pytest.approx(0.05 + W * 0.95)
    assert sp.states[0].accept_rate == 0.9  # the sequence's own rate learnt nothing
    assert sp.plan([(0, copying(), 10)], fresh={0})[0][:1] == [3]
    assert sp.after[0][:2] == [START, OTHER]
    assert sp.plan([(0, copying(), 10)]) == {0: [3, 4, 5, 6]}  # with output: no START
    # the engine's requests: one with no output is fresh
    req = SimpleNamespace(request_id=2, in_prefill=False, num_dropped=0, ids_view=copying(),
                          max_new=20, stats=SimpleNamespace(generation_tokens=0), draft=[],
                          output_ids=[], decoder=SimpleNamespace(speculable=True, grammar=None,
                                                                 eos=set()))
    sp.class_rates[START] = 0.0
    sp.assign([req])
    assert req.draft == [] and sp.after[2] == [START]
    req.output_ids = [7]
    sp.assign([req])
    assert req.draft == [3, 4, 5, 6]


def test_one_token_lookup_and_end_tokens():
    """The default lookup matches on the last token alone when nothing longer repeats;
    drafts stop at an end-of-sequence token (nothing after it is ever used)."""
    assert SpecConfig().min_ngram == 1
    assert LookupIndex(SpecConfig().min_ngram, 4).propose([7, 8, 9, 6, 7], 3) == [8, 9, 6]
    sp = speculator(0.020, 0.002)
    sp.prior = sp.prior_follow = 0.9
    req = SimpleNamespace(request_id=0, in_prefill=False, num_dropped=0, ids_view=copying(),
                          max_new=20, stats=SimpleNamespace(generation_tokens=1), draft=[],
                          output_ids=[1], decoder=SimpleNamespace(speculable=True, grammar=None,
                                                                  eos={4}))
    sp.assign([req])
    assert req.draft == [3, 4]


def test_cost_is_measured_per_batch_size_and_per_draft():
    """Plain steps give each batch size's cost, steps with drafts the cost of a draft token
    (the prefill per-token cost stands in until then); the first steps are not timed."""
    cost = SpecCost(StepPacer(4))
    cost.observe(2, 0, 0.9)  # warm-up: not counted
    assert cost.fit(2) is None and cost.warmup == 2
    cost.warmup = 0
    for _ in range(5):
        cost.observe(2, 0, 0.030)
    assert cost.fit(2) is None  # no draft timed, no prefill measured
    cost.pacer.per_token_s = 0.002
    assert cost.fit(2) == pytest.approx((0.030, 0.002))
    assert cost.fit(3) == pytest.approx((0.030, 0.002))  # the nearest batch size measured
    for _ in range(30):  # the machine got slower: the measures follow
        cost.observe(2, 0, 0.050)
        cost.observe(2, 3, 0.080)
    assert cost.fit(2) == pytest.approx((0.050, 0.010), rel=1e-3)


def test_cost_times_each_step_to_the_next_ones_start(monkeypatch):
    """A decode-only step is timed from its start to the next step's (a plain step and a
    verify step over the same span); per batch size; a pause counts as 3x the estimate;
    a step with a prefill, or after which the batch ended, is not timed."""
    clock = iter([0.0, 0.010, 0.010, 0.024, 0.024, 1.0, 1.0])
    monkeypatch.setattr("engine.spec_cost.time.perf_counter", lambda: next(clock))
    cost = SpecCost(StepPacer(4), warmup=0)
    req = SimpleNamespace(draft=[])
    drafting = SimpleNamespace(draft=[5, 6])
    plan = SimpleNamespace(prefills=[], decodes=[(req, None)])
    cost.start(plan)
    cost.close(going_on=True)  # 0.010 s, one row, no drafts
    cost.start(SimpleNamespace(prefills=[], decodes=[(drafting, None)]))
    cost.close(going_on=True)  # 0.014 s with two drafts: 2 ms each
    assert cost.fit(1) == pytest.approx((0.010, 0.002))
    cost.start(plan)
    cost.close(going_on=True)  # 0.976 s: a pause, counted as 3 x 0.010
    assert cost.plain[1] == pytest.approx(0.7 * 0.010 + 0.3 * 0.030)
    cost.start(SimpleNamespace(prefills=[(req, 4, None)], decodes=[(req, None)]))
    cost.close(going_on=True)  # a prefill chunk rode along: not a decode step's cost
    cost.start(plan)
    cost.close(going_on=False)  # the batch ended: the engine may idle before the next
    assert cost.plain[1] == pytest.approx(0.7 * 0.010 + 0.3 * 0.030)
    cost.plain[8], cost.per[8] = 0.020, 0.001
    assert cost.fit(8) == (0.020, 0.001) and cost.fit(6) == (0.020, 0.001)
    assert cost.fit(2) == pytest.approx((cost.plain[1], 0.002))  # the nearest measured


def test_truncate_gives_back_only_what_the_append_took():
    bm = BlockManager(8, 4)
    bm.allocate(0, 6)
    before = list(bm.free_block_ids)
    bm.append(0, 7)  # 13 tokens: 4 blocks
    assert len(bm.block_tables[0]) == 4
    assert bm.truncate(0, 6) == 2  # back to 7 tokens: 2 blocks
    assert bm.num_tokens[0] == 7 and sorted(bm.free_block_ids) == sorted(before)
    bm.check_invariants()
    with pytest.raises(ValueError):
        bm.truncate(0, 8)
    assert bm.free(0) == 2 and bm.num_free_blocks == 8


def test_rows_and_greedy_acceptance():
    assert rows(7, [8, 9], [40, 41, 42], [10], 12) == [
        (7, 40, [10], 10), (8, 41, [10], 11), (9, 42, [10], 12)]
    assert accepted_greedy([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]
    assert accepted_greedy([5, 6, 7], [5, 1, 7, 8]) == [5, 1]
    assert accepted_greedy([5], [2, 3]) == [2]


LOGITS = mx.array([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2]])


def chi_square(counts: list[int], probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs, strict=True) if p > 0)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.8),
    SamplingParams(temperature=1.0, top_p=0.8),
    SamplingParams(temperature=1.3, top_k=4, min_p=0.05),
])
def test_target_distribution_is_mlx_lm_samplers(params):
    """`target_logits` is what mlx-lm's sampler draws from (chi-square, fixed seed)."""
    probs = mx.softmax(target_logits(params, LOGITS), axis=-1)[0].tolist()
    sampler = params.make_sampler()
    lp = LOGITS - mx.logsumexp(LOGITS, axis=-1, keepdims=True)
    mx.random.seed(1)
    draws = mx.concatenate([sampler(lp) for _ in range(3000)]).tolist()
    counts = [draws.count(t) for t in range(LOGITS.shape[1])]
    assert all(c == 0 for c, p in zip(counts, probs, strict=True) if p == 0)
    assert chi_square(counts, probs) < 24.3  # df <= 7, p = 0.001


@pytest.mark.parametrize("draft", [0, 1, 5])  # the likeliest token, a middling, an unlikely
def test_speculative_sampling_keeps_the_distribution(draft):
    """First token of a step with one draft: same distribution as plain sampling, whether
    the draft is accepted or not (the rejection rule), and the second token only when the
    draft was accepted."""
    params = SamplingParams(temperature=1.0, top_p=0.95)
    two = mx.concatenate([LOGITS, LOGITS[:, ::-1]])
    probs = mx.softmax(target_logits(params, LOGITS), axis=-1)[0].tolist()
    mx.random.seed(7)
    firsts, seconds = [], 0
    for _ in range(3000):
        out = accepted_sampled(params, [draft], two)
        firsts.append(out[0])
        assert len(out) == (2 if out[0] == draft else 1)
        seconds += len(out) == 2
    counts = [firsts.count(t) for t in range(LOGITS.shape[1])]
    assert chi_square(counts, probs) < 24.3
    assert abs(seconds / 3000 - probs[draft]) < 0.04


def test_first_drafts_and_the_drafts_after_a_held_one_are_measured_apart():
    """A copied span goes on once it starts: a step's first draft holds less often than the
    drafts after a held one, and the allotment weighs draft i by first x follow^(i - 1)."""
    sp = speculator(0.020, 0.002)
    sp.plan([(0, copying(), 10)])
    st = sp.states[0]
    st.accept_rate, st.follow_rate = 0.5, 0.5
    sp.observe(0, 4, 3)  # the first held, then 2 of the 3 tried after it
    held = 0.5 + W * 0.5
    assert st.accept_rate == pytest.approx(held)
    assert st.follow_rate == pytest.approx(0.5 + W * (2 / 3 - 0.5))
    sp.observe(0, 1, 0)  # the first failed: nothing after it was tried
    assert st.accept_rate == pytest.approx(held * (1 - W))
    assert st.follow_rate == pytest.approx(0.5 + W * (2 / 3 - 0.5))
    # a 30 % first draft whose spans run on: worth four drafts where 0.3^i gave up after one
    st.accept_rate, st.follow_rate = 0.3, 0.95
    assert sp.plan([(0, copying(), 10)]) == {0: [3, 4, 5, 6]}
    st.follow_rate = 0.3
    assert sp.plan([(0, copying(), 10)]) == {0: [3]}
