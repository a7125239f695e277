"""Reasoning apart from the answer (`app.server.reasoning`): whole answers split once,
streams routed piece by piece however the tags are cut, and the response bodies."""

from __future__ import annotations

import pytest

from app.server import reasoning as rs
from app.server.openai_schema import parse_request
from app.server.responses import Reply
from engine.generation import RequestStats

ANSWER = "<think>\nThe user greets me. Be brief.\n</think>\n\nHello!"


def test_split_whole_answers():
    assert rs.split(ANSWER) == ("The user greets me. Be brief.", "Hello!")
    assert rs.split("Hello!") == (None, "Hello!")
    assert rs.split("still thinking, cut", inside=True) == ("still thinking, cut", "")
    assert rs.split("plan</think>Answer", inside=True) == ("plan", "Answer")
    assert rs.split("<think>never closed") == ("never closed", "")
    assert rs.opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not rs.opens_thinking("<|im_start|>assistant\n")


@pytest.mark.parametrize("cut", [1, 2, 3, 5, 7, 11])
@pytest.mark.parametrize("text,inside", [(ANSWER, False), ("Hello <thin", False),
                                         ("a < b </think>ok", True), ("no tags at all", False)])
def test_streams_route_the_same_text_however_it_is_cut(text, inside, cut):
    s = rs.ReasoningStream(inside)
    thought = content = ""
    for i in range(0, len(text), cut):
        r, c = s.feed(text[i:i + cut])
        thought, content = thought + r, content + c
    r, c = s.flush()
    thought, content = thought + r, content + c
    want_r, want_c = rs.split(text, inside)
    assert content.strip() == want_c.strip()
    assert thought.strip() == (want_r or "")


def test_whole_responses_carry_reasoning_content():
    reply = Reply("chat", "m", "fp", 64)
    msg = reply.completion(ANSWER, "stop", RequestStats())["choices"][0]["message"]
    assert msg == {"role": "assistant", "content": "Hello!",
                   "reasoning_content": "The user greets me. Be brief."}
    plain = reply.completion("Hi.", "stop", RequestStats())["choices"][0]["message"]
    assert plain == {"role": "assistant", "content": "Hi."}
    chunk = reply.chunk(reasoning="hmm")["choices"][0]["delta"]
    assert chunk == {"reasoning_content": "hmm"}


def test_template_switches_are_checked_and_passed_on():
    user = [{"role": "user", "content": "hi"}]
    p = parse_request("chat", {"messages": user, "reasoning_effort": "low",
                               "chat_template_kwargs": {"enable_thinking": False}})
    assert p.template_kwargs == {"enable_thinking": False, "reasoning_effort": "low"}
    from app.server.errors import APIError

    for bad in ({"reasoning_effort": "max"}, {"chat_template_kwargs": {"tools": []}},
                {"chat_template_kwargs": {"enable_thinking": "yes"}}):
        with pytest.raises(APIError):
            parse_request("chat", {"messages": user, **bad})
