"""The draft model's bookkeeping that needs no model (its proposals are checked token for
token in test_speculative_engine.py)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from engine.draft_model import common_prefix

tokens = st.lists(st.integers(0, 3), max_size=40)


@given(tokens, tokens)
def test_common_prefix_is_the_first_difference(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    assert common_prefix(a, b) == n == common_prefix(b, a)


@given(tokens, st.integers(0, 40), tokens)
def test_common_prefix_of_a_rollback(fed, keep, tail):
    """What a sequence's drafts leave: what was fed up to ``keep``, then other tokens."""
    keep = min(keep, len(fed))
    ids = fed[:keep] + tail
    n = keep
    while n < min(len(fed), len(ids)) and fed[n] == ids[n]:
        n += 1
    assert common_prefix(fed, ids) == n
