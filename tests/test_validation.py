"""Validation at the door: a bad request fails alone, in the caller's thread, with a clear line.

The adversarial cases of the hardening issue: out-of-vocabulary and negative ids, ids past
int32, bad seeds, permission versions and tenants, non-finite sampling values. Each must
raise `RequestError` at `submit`, count a rejection, and leave the good requests that run
beside it token-identical to running alone.
"""

from __future__ import annotations

import math
import subprocess
import sys
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import Engine, EngineConfig, RequestError, SamplingParams
from engine.errors import EngineStoppedError
from engine.generation import collect
from engine.validation import check_ids, check_params, check_scope

GOOD = [list(range(100, 130)), list(range(400, 410))]


def good_params() -> SamplingParams:
    return SamplingParams(max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_model):
    e = Engine(tiny_model, EngineConfig(block_size=4, kv_budget_bytes=4 << 20))
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def alone(engine):
    return [engine.generate_text(ids, good_params()).tokens for ids in GOOD]


BAD_PARAMS = [
    ("seed", -1), ("seed", 2**64), ("seed", 1.5), ("temperature", math.nan),
    ("temperature", math.inf), ("temperature", -0.1), ("top_p", 2.0), ("top_p", -1.0),
    ("top_k", -3), ("min_p", 1.5), ("max_tokens", 0), ("max_tokens", -5),
    ("repetition_penalty", math.nan), ("repetition_penalty", 0.0), ("stop", [""]),
    ("stop", "x"), ("stop", [1]),
]


@pytest.mark.parametrize("field,value", BAD_PARAMS)
def test_bad_sampling_values_name_their_field(field, value):
    p = good_params()
    setattr(p, field, value)  # a client may change a field after construction
    with pytest.raises(RequestError, match=field):
        check_params(p)


def test_constructor_rejects_bad_values_too():
    with pytest.raises(RequestError, match="top_p"):
        SamplingParams(top_p=2)
    with pytest.raises(ValueError):  # RequestError is a ValueError
        SamplingParams(max_tokens=0)


@pytest.mark.parametrize("ids", [[60000] * 20, [-1, 5], [2**31], [2**40], [1.5], ["a"], [True]])
def test_ids_outside_the_vocabulary(ids):
    with pytest.raises(RequestError, match=r"token ids must be integers in \[0, 49152\)"):
        check_ids(ids, 49152)


@pytest.mark.parametrize("tenant,pv,timeout,field", [
    ("", 0, None, "tenant"), ("x" * 129, 0, None, "tenant"), (None, 0, None, "tenant"),
    ("a", -1, None, "permission_version"), ("a", 2**63, None, "permission_version"),
    ("a", "1", None, "permission_version"), ("a", 0, math.nan, "timeout_s"),
    ("a", 0, -1, "timeout_s"),
])
def test_bad_scope(tenant, pv, timeout, field):
    with pytest.raises(RequestError, match=field):
        check_scope(tenant, pv, timeout)


@pytest.mark.subprocess
def test_out_of_vocabulary_ids_do_not_crash_the_process(tiny_model):
    # the reproduction segfaulted (exit 139): run it where a crash cannot take pytest down
    code = (
        "from engine import Engine, EngineConfig, RequestError, SamplingParams, load_model\n"
        f"e = Engine(load_model({str(tiny_model.path)!r}), EngineConfig(kv_budget_bytes=1<<22))\n"
        "try:\n    e.submit([60000] * 20, SamplingParams(max_tokens=2))\n"
        "except RequestError as err:\n    print('rejected:', err)\n"
        "print(e.generate_text([5, 6, 7], SamplingParams(max_tokens=2)).finish_reason)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "rejected: prompt token 0 is 60000" in out.stdout
    assert out.stdout.strip().endswith("length")


@st.composite
def bad_request(draw):
    """One bad field among otherwise good ones: ids, a sampling value, or the scope."""
    kind = draw(st.sampled_from(["ids", "params", "scope"]))
    ids, params, kw = list(range(200, 210)), good_params(), {}
    if kind == "ids":
        bad = draw(st.one_of(st.integers(max_value=-1), st.integers(min_value=49152),
                             st.floats(allow_nan=True), st.booleans()))
        ids[draw(st.integers(0, 9))] = bad
    elif kind == "params":
        field, value = draw(st.sampled_from(BAD_PARAMS))
        setattr(params, field, value)
    else:
        kw = draw(st.sampled_from([
            dict(tenant=""), dict(tenant="t" * 500), dict(permission_version=-1),
            dict(permission_version=2**70), dict(timeout_s=math.inf), dict(priority=7),
        ]))
    return ids, params, kw


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(bad=bad_request())
def test_a_bad_request_among_good_ones_fails_alone(engine, alone, bad):
    ids, params, kw = bad
    rejections = engine.metrics().rejections
    handles = [engine.submit(GOOD[0], good_params())]
    with pytest.raises(RequestError):
        engine.submit(ids, params, **kw)
    handles.append(engine.submit(GOOD[1], good_params()))
    assert [collect(h).tokens for h in handles] == alone
    assert engine.metrics().rejections == rejections + 1
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_bad_request_on_the_engine_thread_fails_alone(tiny_model, alone):
    e = Engine(tiny_model, EngineConfig(block_size=4, kv_budget_bytes=4 << 20))
    e.start()
    good = [e.submit(ids, good_params()) for ids in GOOD]
    bad = good_params()
    bad.seed = -1  # reached mx.random.seed at admission and failed every live request
    for ids, p, kw in (([60000] * 5, good_params(), {}), (GOOD[0], bad, {}),
                       (GOOD[0], good_params(), {"permission_version": -1}),
                       ([2**31] * 3, good_params(), {})):
        with pytest.raises(RequestError):
            e.submit(ids, p, **kw)
    assert [collect(h).tokens for h in good] == alone
    e.shutdown()


def test_iterating_a_finished_handle_again_ends_at_once(engine):
    h = engine.submit(GOOD[1], good_params())
    assert collect(h).finish_reason == "length"
    assert list(h) == [] and h.done and h.poll() is None


def test_nothing_is_served_after_shutdown(tiny_model):
    e = Engine(tiny_model, EngineConfig(block_size=4, kv_budget_bytes=4 << 20))
    e.start()
    served, refused = [], []
    stop = threading.Event()

    def client():
        while not stop.is_set():
            try:
                served.append(e.submit(GOOD[1], good_params()))
            except EngineStoppedError:
                refused.append(1)
                return

    t = threading.Thread(target=client)
    t.start()
    e.shutdown()
    stop.set()
    t.join()
    # every request accepted before shutdown ended (served or "shutdown"); none is left
    ends = {collect(h).finish_reason for h in served}
    assert ends <= {"length", "shutdown"}
    assert e.live_requests() == 0 and e.blocks.num_free_blocks == e.blocks.num_blocks
    with pytest.raises(EngineStoppedError):
        e.submit(GOOD[1], good_params())
