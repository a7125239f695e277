"""`engine.greedy`: the CPU extension's greedy pick equals mlx-lm's
``argmax(logits - logsumexp(logits))`` on every row, including rows built so that rounding
makes the raw argmax the wrong answer."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import greedy
from engine.model.cpu_ext import build, ops

DTYPES = [mx.float32, mx.float16, mx.bfloat16]


@pytest.fixture(scope="module", autouse=True)
def ext():
    if not build.available():
        pytest.skip(f"CPU extension unavailable: {build.unavailable_reason()}")


def check(rows: np.ndarray, dtype) -> list[int]:
    logits = mx.array(rows.astype(np.float32)).astype(dtype)
    want = greedy.exact(logits).tolist()
    assert greedy.tokens(logits, fast=True) == want
    assert greedy.tokens(logits, fast=False) == want
    return want


@pytest.mark.parametrize("dtype", DTYPES)
def test_rounding_tie_takes_the_exact_path(dtype):
    # An earlier entry a hair below the max, and a small max: logits - logsumexp rounds both
    # to one value in half precision, so mlx-lm picks the earlier one, not the raw argmax.
    V = 49152
    row = np.zeros((1, V), np.float32)
    row[0, 0] = -(2.0 ** -14)
    logits = mx.array(row).astype(dtype)
    want = greedy.exact(logits).tolist()
    assert greedy.tokens(logits, fast=True) == want
    if dtype != mx.float32:  # the pick declines: an earlier entry within its steps of the max
        assert ops.greedy_pick(logits).tolist() == [-1]
        assert want == [0] and mx.argmax(logits, axis=-1).tolist() == [1]  # raw would be wrong
    else:  # 2^-14 is ~64 float32 steps at ln V + 1: no rounding can tie them
        assert ops.greedy_pick(logits).tolist() == want == [1]


@pytest.mark.parametrize("dtype", DTYPES)
def test_small_maxima_without_near_ties_are_picked(dtype):
    """Rows whose max is below ln V + 1 (an unsure model) need no exact path unless an earlier
    entry sits within a few of the dtype's steps of the max: a pipelined decode feeds these
    picks unread, so a declined row costs it a rebuilt step."""
    rng = np.random.default_rng(2)
    rows = (rng.normal(size=(8, 49152)) * 1.5).astype(np.float32)
    rows[np.arange(8), rng.integers(0, 49152, 8)] = 10.0  # a max, below ln V + 1 = 11.8
    picked = ops.greedy_pick(mx.array(rows).astype(dtype)).tolist()
    assert all(t >= 0 for t in picked)
    assert picked == check(rows, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_large_max_is_picked_without_the_exact_path(dtype):
    rng = np.random.default_rng(0)
    rows = rng.normal(size=(6, 49152)).astype(np.float32) * 3
    rows[np.arange(6), rng.integers(0, 49152, 6)] = 25.0
    rows[1, :100] = 25.0  # ties in the raw logits: the first one wins in both
    picked = ops.greedy_pick(mx.array(rows).astype(dtype)).tolist()
    assert all(t >= 0 for t in picked)
    assert picked == check(rows, dtype)
    assert picked[1] == 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_non_finite_rows_take_the_exact_path(dtype):
    rows = np.random.default_rng(1).normal(size=(4, 1000)).astype(np.float32) + 20
    rows[0, 5], rows[1, 7], rows[2, 9] = np.nan, np.inf, -np.inf
    picked = ops.greedy_pick(mx.array(rows).astype(dtype)).tolist()
    assert picked[:3] == [-1, -1, -1] and picked[3] >= 0
    check(rows, dtype)


def next_down(v: np.float32, dtype) -> np.float32:
    """The dtype's next value below ``v`` (a value it holds), as float32."""
    if dtype == mx.float32:
        return np.nextafter(v, np.float32(-math.inf))
    if dtype == mx.float16:
        return np.float32(np.nextafter(np.float16(v), np.float16(-math.inf)))
    b = int(np.array(v, np.float32).view(np.uint32)) >> 16  # bfloat16: float32's top half
    b = 0x8001 if b == 0 else b - 1 if b < 0x8000 else b + 1
    return np.array(b << 16, np.uint32).view(np.float32)[()]


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 5), st.sampled_from([1, 50, 300, 49152]), st.sampled_from(DTYPES),
       st.floats(-40, 40), st.floats(0.01, 8), st.integers(0, 2 ** 31 - 1), st.booleans(),
       st.integers(1, 40))
def test_pick_equals_mlx_lm_on_any_rows(rows, vocab, dtype, top, spread, seed, near_ties,
                                        steps):
    """Random rows around maxima from -40 to 40 (both sides of ln V + 1), optionally with
    entries 1 to 40 of the dtype's steps below the max ahead of it (the pick's near-tie
    rule declines within 4 steps at ln V + 1): the answer is always mlx-lm's."""
    rng = np.random.default_rng(seed)
    x = (top - spread * np.abs(rng.normal(size=(rows, vocab)))).astype(np.float32)
    x = np.asarray(mx.array(x).astype(dtype).astype(mx.float32))  # values the dtype holds
    if near_ties:
        for r in range(rows):
            at = int(rng.integers(0, vocab))
            x[r, at] = top
            below = np.float32(top)
            for _ in range(steps):
                below = next_down(below, dtype)
            x[r, : at] = np.where(rng.random(at) < 0.5, below, x[r, : at])
    check(x, dtype)
