"""Streaming generation: stop strings, EOS, length, release of blocks on every way out."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine import SamplingParams
from engine.decoder import StopMatcher
from engine.errors import RequestError, RequestTooLargeError


@given(text=st.text(max_size=60), stop=st.text(min_size=1, max_size=5),
       cuts=st.lists(st.integers(0, 60), max_size=8))
def test_stop_matcher_equals_find_on_whole_text(text, stop, cuts):
    pieces, last = [], 0
    for c in sorted(cuts):
        pieces.append(text[last:c])
        last = max(last, c)
    pieces.append(text[last:])
    m = StopMatcher([stop])
    out, hit = "", False
    for p in pieces:
        emitted, hit = m.feed(p)
        out += emitted
        if hit:
            break
    if not hit:
        out += m.flush()
    idx = text.find(stop)
    assert hit == (idx >= 0)
    assert out == (text[:idx] if idx >= 0 else text)
    assert m.matched == (stop if hit else None)


def test_stop_matcher_names_the_earliest_stop_string():
    m = StopMatcher(["lazy", "fox", "quick brown"])
    assert m.feed("the quick brown fox jumps over the lazy dog") == ("the ", True)
    assert m.matched == "quick brown"


def test_stop_string_ends_generation(default_engine):
    ids = default_engine.encode_prompt("What is the capital of France?")
    r = default_engine.generate_text(ids, SamplingParams(max_tokens=30, stop=["France"]))
    assert (r.text, r.finish_reason) == ("The capital of ", "stop")


def test_length_and_exact_token_count(default_engine):
    ids = default_engine.encode_prompt("Tell me a long story about a cat.")
    r = default_engine.generate_text(ids, SamplingParams(max_tokens=5))
    tokens, finish, stats = r.tokens, r.finish_reason, r.stats
    assert finish == "length" and len(tokens) == 5 == stats.generation_tokens
    assert stats.ttft_s > 0 and stats.prefill_tps > 0 and stats.decode_tps > 0
    assert len(stats.inter_token_s) == 4


def test_consumer_going_away_releases_blocks(default_engine):
    bm = default_engine.blocks
    ids = default_engine.encode_prompt("Tell me a long story about a cat.")
    stream = default_engine.generate(ids, SamplingParams(max_tokens=50))
    next(stream)
    assert bm.num_free_blocks < bm.num_blocks
    stream.close()  # disconnect
    assert bm.num_free_blocks == bm.num_blocks
    bm.check_invariants()


def test_sampling_with_seed_is_reproducible(default_engine):
    ids = default_engine.encode_prompt("Write a one-line poem.")
    p = SamplingParams(max_tokens=12, temperature=0.9, seed=7)
    a = default_engine.generate_text(ids, p).tokens
    b = default_engine.generate_text(ids, p).tokens
    assert a == b


def test_bad_requests(default_engine):
    with pytest.raises(RequestError):
        default_engine.encode_prompt("  ")
    rejected = default_engine.metrics().rejections
    with pytest.raises(RequestTooLargeError, match="context"):
        default_engine.submit([1] * 9000, SamplingParams())
    assert default_engine.metrics().rejections == rejected + 1
    fits = default_engine.submit([1] * 8, SamplingParams(max_tokens=3))
    assert (fits.max_tokens, fits.notice) == (3, None)  # granted as asked
    fits.cancel()
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=0)
    assert default_engine.blocks.num_free_blocks == default_engine.blocks.num_blocks
