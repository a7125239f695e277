"""Constrained decoding (`engine.constraint`) on the real default model, inside continuous
batching: outputs validate, neighbours are untouched, bad constraints fail alone, and
preemption, cancellation and finish keep the matcher exact."""

from __future__ import annotations

import json

import jsonschema
import pytest

from engine import Constraint, Engine, EngineConfig, SamplingParams
from engine.errors import RequestError

NAME = {"type": "string", "maxLength": 12}
SCHEMAS = [
    {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0,
                                                             "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
     "required": ["color"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9},
     "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {
        "city": {"type": "object", "properties": {"name": NAME,
                                                  "zip": {"type": "string",
                                                          "pattern": "^[0-9]{5}$"}},
                 "required": ["name", "zip"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
     "required": ["city", "tags"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"},
                                      "score": {"type": "number", "minimum": -1,
                                                "maximum": 1}},
     "required": ["ok", "score"], "additionalProperties": False},
]
PROMPTS = ["Describe a person as JSON.", "Pick a color.", "Give me some numbers.",
           "Where do you live?", "Rate this answer."]


@pytest.fixture(scope="module")
def engine(quick_model):
    eng = Engine(quick_model, EngineConfig(kv_budget_bytes=64 << 20, max_running=8))
    yield eng
    eng.shutdown()


def run(eng, ids, params):
    r = eng.generate_text(ids, params)
    return r.tokens, r.text, r.finish_reason


def test_outputs_validate_batched_greedy_and_sampled(engine):
    """Ten constrained requests (greedy and sampled) and one free neighbour in one batch."""
    ids = [engine.encode_prompt(p) for p in PROMPTS]
    free_ids = engine.encode_prompt("Tell me about the sea.")
    free = SamplingParams(max_tokens=24, ignore_eos=True)
    alone = run(engine, free_ids, free)[0]
    handles = []
    for i, schema in enumerate(SCHEMAS):
        for temp in (0.0, 0.9):
            p = SamplingParams(max_tokens=120, temperature=temp, seed=i,
                               constraint=Constraint.json_schema(schema))
            handles.append((schema, engine.submit(ids[i], p)))
    neighbour = engine.submit(free_ids, free)
    for schema, h in handles:
        text = "".join(e.text for e in h)
        jsonschema.validate(json.loads(text), schema)  # parses and validates, every one
    assert [e.token for e in neighbour if e.token is not None] == alone  # untouched
    assert engine.metrics().blocks_used == 0


def test_a_grammar_that_admits_everything_changes_no_token(engine):
    """The mask is exact: where the grammar allows what greedy picks, the tokens are
    greedy's own (and the sampled-path pick equals the batched argmax)."""
    ids = engine.encode_prompt("What is the capital of France?")
    plain = run(engine, ids, SamplingParams(max_tokens=20))
    masked = run(engine, ids, SamplingParams(max_tokens=20,
                                             constraint=Constraint("regex", r"[\s\S]*")))
    assert masked == plain


def test_regex_and_grammars_hold(engine):
    ids = engine.encode_prompt("Give a phone number.")
    _, text, finish = run(engine, ids, SamplingParams(
        max_tokens=30, constraint=Constraint("regex", r"\(\d{3}\) \d{3}-\d{4}")))
    import re

    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", text) and finish == "stop"
    lark = Constraint("grammar", 'start: ("yes" | "no") "." ')
    gbnf = Constraint("grammar", 'root ::= ("yes" | "no") "."')
    for c in (lark, gbnf):
        _, text, finish = run(engine, ids, SamplingParams(max_tokens=10, constraint=c))
        assert text in ("yes.", "no.") and finish == "stop"
    _, text, _ = run(engine, ids, SamplingParams(max_tokens=60,
                                                 constraint=Constraint("json_object")))
    # a JSON object, or the start of one cut at max_tokens (finish "length" says so)
    assert text.startswith("{")


@pytest.mark.parametrize("bad,message", [
    (lambda: Constraint("regex", "[a-"), "invalid regex"),
    (lambda: Constraint("grammar", "start: nothing_defined"), "invalid grammar"),
    (lambda: Constraint.json_schema({"type": "nonsense"}), "invalid json_schema"),
    (lambda: Constraint.json_schema("{not json"), "not valid JSON"),
    (lambda: Constraint.json_schema([1, 2]), "must be an object"),
    (lambda: Constraint("xml", "<a/>"), "kind must be one of"),
    (lambda: Constraint("regex", ""), "is empty"),
])
def test_bad_constraints_fail_alone_with_one_line(engine, bad, message):
    before = engine.metrics()
    with pytest.raises(RequestError, match=message) as info:
        engine.submit(engine.encode_prompt("hi"), SamplingParams(max_tokens=4, constraint=bad()))
    assert "\n" not in str(info.value)
    after = engine.metrics()
    assert after.blocks_used == 0 and after.running == 0 and after.waiting == 0
    if before.rejections is not None:
        assert after.rejections >= before.rejections
    assert run(engine, engine.encode_prompt("hi"), SamplingParams(max_tokens=2))[2] == "length"


def test_not_a_constraint_object_is_refused(engine):
    p = SamplingParams(max_tokens=2)
    p.constraint = {"type": "json_object"}
    with pytest.raises(RequestError, match="engine.Constraint"):
        engine.submit([1, 2, 3], p)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_and_cancelled_requests_keep_their_matchers_exact(quick_model, mode):
    probe = Engine(quick_model, EngineConfig(kv_budget_bytes=1 << 20))
    eng = Engine(quick_model, EngineConfig(kv_budget_bytes=14 * probe.layout.bytes_per_block,
                                           max_running=6, preempt_mode=mode))
    schema = SCHEMAS[2]
    c = Constraint.json_schema({"type": "array", "items": SCHEMAS[0], "minItems": 3,
                                "maxItems": 3})
    ids = [eng.encode_prompt(f"List three people, batch {i}.") for i in range(4)]
    handles = [eng.submit(i, SamplingParams(max_tokens=90, constraint=c)) for i in ids]
    cancel = eng.submit(ids[0], SamplingParams(max_tokens=90, constraint=Constraint.json_schema(
        schema)))
    it = iter(cancel)
    next(it)
    cancel.cancel()
    assert list(it)[-1].finish_reason == "cancelled"
    for h in handles:
        events = list(h)
        text = "".join(e.text for e in events)
        if events[-1].finish_reason == "stop":
            jsonschema.validate(json.loads(text), {"type": "array", "items": SCHEMAS[0]})
        else:  # cut at max_tokens: what came is still a prefix the grammar accepts
            assert events[-1].finish_reason == "length" and text.startswith("[")
    m = eng.metrics()
    assert m.preemptions > 0, "no pressure"
    assert m.blocks_used == 0
    eng.shutdown()


def test_logit_bias_and_penalties_change_the_choice_and_are_checked(engine):
    ids = engine.encode_prompt("What is the capital of France?")
    plain = run(engine, ids, SamplingParams(max_tokens=6))[0]
    banned = run(engine, ids, SamplingParams(max_tokens=6, logit_bias={plain[0]: -100.0}))[0]
    assert banned[0] != plain[0]  # the biased-away token is never picked
    forced = run(engine, ids, SamplingParams(max_tokens=3, logit_bias={42: 100.0}))[0]
    assert forced == [42, 42, 42]
    loops = SamplingParams(max_tokens=40, ignore_eos=True)
    base = run(engine, engine.encode_prompt("Repeat: la la la la"), loops)[0]
    pen = run(engine, engine.encode_prompt("Repeat: la la la la"),
              SamplingParams(max_tokens=40, ignore_eos=True, frequency_penalty=2.0,
                             presence_penalty=2.0))[0]
    assert len(set(pen)) > len(set(base))  # penalized: more distinct tokens
    for bad in ({"logit_bias": {engine.vocab_size: 1.0}}, {"logit_bias": {1: 200.0}},
                {"frequency_penalty": 3.0}, {"presence_penalty": float("nan")}):
        with pytest.raises(RequestError):
            p = SamplingParams(max_tokens=2)
            for k, v in bad.items():
                setattr(p, k, v)
            engine.submit(ids, p)
    assert engine.metrics().blocks_used == 0
