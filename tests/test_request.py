"""`engine.request.Joined`: a request's prompt and output read as one token list in place."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.lookup import LookupIndex
from engine.request import Joined

tokens = st.lists(st.integers(0, 50), max_size=12)
index = st.integers(-30, 30) | st.none()


@given(tokens, tokens, index, index, st.sampled_from([None, 1, 2, -1]))
def test_slices_are_the_joined_lists(head, tail, start, stop, step):
    both = head + tail
    view = Joined(head, tail)
    assert len(view) == len(both)
    assert view[start:stop:step] == both[start:stop:step]
    assert list(view) == both


@given(tokens, tokens, st.integers(-30, 30))
def test_an_index_is_the_joined_lists_or_an_index_error(head, tail, i):
    both = head + tail
    if -len(both) <= i < len(both):
        assert Joined(head, tail)[i] == both[i]
    else:
        with pytest.raises(IndexError):
            Joined(head, tail)[i]


@given(tokens, st.lists(st.integers(0, 50), min_size=1, max_size=12), st.integers(1, 6))
def test_lookup_proposes_the_same_from_the_view(prompt, output, k):
    """What speculation reads (`Speculator.assign` passes the view, not ``all_ids``)."""
    a, b = LookupIndex(1, 4), LookupIndex(1, 4)
    for n in range(1, len(output) + 1):  # as the answer grows, token by token
        assert a.propose(prompt + output[:n], k) == b.propose(Joined(prompt, output[:n]), k)
