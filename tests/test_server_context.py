"""The served context policy (app.server.context) on a scripted engine: what it cuts,
summarizes or refuses, and what the response says about it."""

from __future__ import annotations

import asyncio

import pytest

from app.server.context import apply
from app.server.errors import APIError
from app.server.openai_schema import ParsedRequest
from app.server.responses import Reply


class Handle:
    def __init__(self, text):
        from engine.generation import GenerationEvent

        self.events = [GenerationEvent(0, None, text, "stop")]

    def __iter__(self):
        return iter(self.events)

    def cancel(self):
        pass


class Engine:
    max_context = 10_000

    def __init__(self):
        self.summary_requests = 0

    def count_tokens(self, text):
        return len(text.split())

    def encode_prompt(self, prompt, *, system=None, history=None):
        return list(range(self.count_tokens(prompt)))

    def submit(self, ids, params, **kwargs):
        self.summary_requests += 1
        return Handle("the user's code is 4817")


class State:
    def __init__(self, policy, budget):
        self.engine, self.context_policy, self.context_budget = Engine(), policy, budget

    async def run_tokenizer(self, fn, *args):
        return fn(*args)


def encode(engine, parsed):
    return list(range(sum(len(m["content"].split()) + 4 for m in parsed.messages)))


def chat(turns):
    return ([{"role": "system", "content": "be brief"}]
            + [{"role": r, "content": f"turn {i} " + "w " * 30}
               for i in range(turns) for r in ("user", "assistant")]
            + [{"role": "user", "content": "what was my code?"}])


def run(policy, budget, turns=6):
    state, parsed = State(policy, budget), ParsedRequest("chat", messages=chat(turns))
    ids = encode(state.engine, parsed)
    out = asyncio.run(apply(state, parsed, ids, 16, encode))
    return state, parsed, out


def test_within_the_budget_nothing_changes():
    _, parsed, ids = run("truncate", 10_000)
    assert parsed.context is None and parsed.messages == chat(6) and len(ids) > 200


def test_truncate_keeps_system_and_last_and_reports_the_cut():
    _, parsed, ids = run("truncate", 120)
    assert len(ids) <= 120
    assert parsed.messages[0] == {"role": "system", "content": "be brief"}
    assert parsed.messages[-1]["content"] == "what was my code?"
    assert parsed.context["truncated_turns"] >= 4 and parsed.context["notes"]
    reply = Reply("chat", "m", "f", 16, context=parsed.context)
    assert reply.extras()["truncated_turns"] == parsed.context["truncated_turns"]


def test_summarize_sends_a_summary_of_what_truncate_would_cut():
    state, parsed, ids = run("summarize", 150)
    assert state.engine.summary_requests >= 1
    assert "the user's code is 4817" in parsed.messages[0]["content"]
    assert parsed.messages[0]["content"].startswith("be brief")
    assert parsed.context["summarized_turns"] >= 1 and len(ids) <= 150
    reply = Reply("chat", "m", "f", 16, context=parsed.context,
                  notice="; ".join(parsed.context["notes"]))
    assert "summarized" in reply.headers()["X-Kvchat-Notice"]
    reply.headers()["X-Kvchat-Notice"].encode("latin-1")  # a header's charset: no 1–6 dash


def test_error_leaves_it_to_the_engine_unless_a_budget_is_given():
    _, parsed, ids = run("error", None, turns=400)  # the context decides: OpenAI's 400
    assert parsed.context is None and len(ids) > 10_000
    with pytest.raises(APIError) as info:
        run("error", 100)
    assert info.value.code == "context_length_exceeded"


@pytest.mark.subprocess
def test_a_served_truncation_is_in_the_body_and_the_header(tmp_path):
    import httpx
    from test_server_process import ServerProcess

    srv = ServerProcess(tmp_path, "--no-disk-cache", "--kv-budget", "64M",
                        "--context-policy", "truncate", "--context-budget", "96").start()
    try:
        body = {"model": "kvchat", "max_tokens": 4, "temperature": 0, "messages": chat(3)}
        r = httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        k = r.json()["kvchat"]
        assert k["truncated_turns"] >= 1 and k["context"]["policy"] == "truncate"
        assert r.json()["usage"]["prompt_tokens"] <= 96
        assert "left out" in r.headers["X-Kvchat-Notice"] and "left out" in k["notice"]
        anthropic = {"model": "kvchat", "max_tokens": 4, "system": "be brief",
                     "messages": chat(3)[1:]}
        m = httpx.post(f"{srv.url}/v1/messages", json=anthropic, timeout=120)
        assert m.status_code == 200, m.text
        assert m.json()["kvchat"]["truncated_turns"] >= 1
        assert "left out" in m.headers["X-Kvchat-Notice"]
    finally:
        assert srv.stop() == 0, srv.log()
