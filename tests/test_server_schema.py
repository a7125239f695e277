"""The server's parts without a server: request parsing, reply shapes, keys, the event pump."""

from __future__ import annotations

import asyncio
import json

import pytest
from test_server_process import write_keys

from app.server.command import check_host
from app.server.errors import APIError
from app.server.keys import LOCAL, KeysFileError, KeyStore, Principal, bearer_key
from app.server.openai_schema import parse_request
from app.server.responses import Reply, sse
from app.server.streaming import EventPump
from engine.errors import KVChatError
from engine.generation import GenerationEvent, RequestStats

USER = [{"role": "user", "content": "hi"}]


def chat(**fields):
    return parse_request("chat", {"messages": USER, **fields})


def refused(kind: str, body) -> APIError:
    with pytest.raises(APIError) as info:
        parse_request(kind, body)
    err = info.value
    assert err.status == 400 and set(err.body()["error"]) == {"message", "type", "param", "code"}
    return err


# -- parsing ---------------------------------------------------------------------------

def test_chat_fields_and_defaults():
    p = chat(model="anything", max_tokens=7, temperature=0, top_p=0.5, stop="END", seed=3,
             stream=True, stream_options={"include_usage": True}, user="u", n=1,
             logprobs=False, presence_penalty=0, tools=[], response_format={"type": "text"})
    assert (p.kind, p.max_tokens, p.temperature, p.top_p, p.seed) == ("chat", 7, 0.0, 0.5, 3)
    assert p.stop == ["END"] and p.stream and p.include_usage
    d = chat()
    assert (d.max_tokens, d.temperature, d.top_p, d.stream, d.include_usage) == (
        None, 1.0, 1.0, False, False)  # OpenAI's defaults; max_tokens: the server's


def test_null_means_default_and_max_completion_tokens():
    p = chat(temperature=None, stop=None, seed=None, max_completion_tokens=9)
    assert (p.temperature, p.stop, p.seed, p.max_tokens) == (1.0, [], None, 9)


def test_messages_are_normalized():
    p = parse_request("chat", {"messages": [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": []},
        {"role": "user", "content": "c", "name": "me"}]})
    assert p.messages == [{"role": "system", "content": "be brief"},
                          {"role": "user", "content": "ab"},
                          {"role": "assistant", "content": ""},
                          {"role": "user", "content": "c"}]
    assert p.text_chars == len("be brief") + 3


@pytest.mark.parametrize("fields,param,code", [
    ({"n": 0}, "n", None),
    ({"n": True}, "n", None),
    ({"n": 129}, "n", None),
    ({"logprobs": 1}, "logprobs", None),
    ({"logprobs": "yes"}, "logprobs", None),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", None),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs", None),
    ({"top_logprobs": 2}, "top_logprobs", None),
    ({"thinking_budget": -1}, "thinking_budget", None),
    ({"thinking_budget": 8, "response_format": {"type": "json_object"}}, "thinking_budget",
     None),
    ({"tools": [{"type": "function"}]}, "tools[0]", None),
    ({"response_format": {"type": "xml"}}, "response_format", None),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": "{"}}},
     "response_format.json_schema.schema", None),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}},
     "response_format.json_schema.schema", None),
    ({"response_format": {"type": "json_schema", "json_schema": []}},
     "response_format.json_schema", None),
    ({"response_format": {"type": "json_object"}, "regex": "a+"}, "regex", None),
    ({"grammar": 7}, "grammar", None),
    ({"regex": ""}, "regex", None),
    ({"regex": "a" * 300_000}, "regex", None),
    ({"frequency_penalty": 2.5}, "frequency_penalty", None),
    ({"logit_bias": {"abc": 1}}, "logit_bias", None),
    ({"logit_bias": {"12": 101}}, "logit_bias", None),
    ({"bogus": 1}, "bogus", "unknown_parameter"),
    ({"temperature": 3}, "temperature", None),
    ({"temperature": "hot"}, "temperature", None),
    ({"top_p": -0.1}, "top_p", None),
    ({"max_tokens": 0}, "max_tokens", None),
    ({"max_tokens": True}, "max_tokens", None),
    ({"seed": -1}, "seed", None),
    ({"stop": ["a", ""]}, "stop", None),
    ({"stop": ["s"] * 17}, "stop", None),
    ({"stream_options": {"include_usage": True}}, "stream_options", None),
    ({"max_tokens": 5, "max_completion_tokens": 6}, "max_completion_tokens", None),
])
def test_chat_refusals_name_the_field(fields, param, code):
    err = refused("chat", {"messages": USER, **fields})
    assert (err.param, err.code) == (param, code)


def test_response_formats_become_constraints():
    from engine import Constraint

    def constraint(**fields):
        return parse_request("chat", {"messages": USER, **fields}).constraint

    assert constraint() is None and constraint(response_format={"type": "text"}) is None
    assert constraint(response_format={"type": "json_object"}) == Constraint("json_object")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    got = constraint(response_format={"type": "json_schema", "json_schema": {
        "name": "thing", "strict": True, "schema": schema}})
    assert got == Constraint.json_schema(schema) and got.kind == "json_schema"
    assert constraint(response_format={"type": "json_schema", "json_schema": {"name": "x"}}) \
        == Constraint("json_object")  # no schema: any JSON object
    assert constraint(json_schema=schema) == Constraint.json_schema(schema)  # llama.cpp's
    assert constraint(grammar='root ::= "yes" | "no"').kind == "grammar"
    assert constraint(regex="[0-9]+") == Constraint("regex", "[0-9]+")
    text = parse_request("text", {"prompt": "x", "regex": "[ab]"})
    assert text.constraint == Constraint("regex", "[ab]")


@pytest.mark.parametrize("messages,param", [
    (None, "messages"),
    ([], "messages"),
    ("hi", "messages"),
    ([{"role": "assistant", "content": "x"}], "messages[0]"),
    ([{"role": "function", "content": "x"}], "messages[0].role"),
    ([{"role": "wizard", "content": "x"}], "messages[0].role"),
    ([{"role": ["user"], "content": "x"}], "messages[0].role"),
    ([{"role": {"user": 1}, "content": "x"}], "messages[0].role"),
    ([{"role": "user", "content": "a\ud800b"}], "messages[0].content"),
    ([{"role": "system", "content": "\udc00"}, {"role": "user", "content": "x"}],
     "messages[0].content"),
    ([{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}],
     "messages[0].content"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
     "messages[0].content"),
    ([{"role": "user", "content": "  "}], "messages[0].content"),
    ([{"role": "user", "content": "x", "audio": {}}], "messages[0].audio"),
])
def test_bad_messages(messages, param):
    assert refused("chat", {"messages": messages}).param == param


@pytest.mark.parametrize("kind,fields,param", [
    ("text", {"prompt": "\ud800 then \udfff"}, "prompt"),
    ("text", {"prompt": "x", "stop": ["\ud800"]}, "stop"),
    ("chat", {"messages": USER, "user": "\ud800"}, "user"),
    ("chat", {"messages": USER, "regex": "\udfff+"}, "regex"),
])
def test_lone_surrogates_are_400_naming_the_field(kind, fields, param):
    assert refused(kind, fields).param == param


def test_completion_prompts():
    assert parse_request("text", {"prompt": "Once"}).prompt == "Once"
    assert parse_request("text", {"prompt": ["Once"]}).prompt == "Once"
    assert parse_request("text", {"prompt": [1, 2, 3]}).prompt == [1, 2, 3]
    assert parse_request("text", {"prompt": [[4, 5]]}).prompt == [4, 5]
    assert refused("text", {"prompt": ["a", "b"]}).code == "unsupported_value"
    assert refused("text", {"prompt": ""}).param == "prompt"
    assert refused("text", {"prompt": "a", "echo": True}).param == "echo"
    assert refused("text", {"prompt": "a", "messages": USER}).code == "unknown_parameter"
    assert refused("text", [1, 2]).param is None  # not an object


# -- replies -----------------------------------------------------------------------------

def stats(**kw) -> RequestStats:
    return RequestStats(**{"prompt_tokens": 40, "generation_tokens": 5, "cached_tokens": 32,
                           "cache_source": "memory", **kw})


def test_completion_and_usage_shapes():
    r = Reply("chat", model="m", fingerprint="fp", max_tokens=5, notice="reduced")
    body = r.completion("Paris.", "stop", stats())
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Paris."}
    assert body["usage"] == {"prompt_tokens": 40, "completion_tokens": 5, "total_tokens": 45,
                             "prompt_tokens_details": {"cached_tokens": 32}}
    assert body["kvchat"]["max_tokens"] == 5 and body["kvchat"]["notice"] == "reduced"
    assert r.headers() == {"X-Kvchat-Max-Tokens": "5", "X-Kvchat-Notice": "reduced"}
    text = Reply("text", model="m", fingerprint="fp", max_tokens=5)
    assert text.completion("x", "length", stats())["choices"][0]["text"] == "x"
    assert "X-Kvchat-Notice" not in text.headers()


def test_stream_chunks():
    r = Reply("chat", model="m", fingerprint="fp", max_tokens=5)
    first = r.chunk("", role=True, include_usage=True)
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert first["usage"] is None and first["object"] == "chat.completion.chunk"
    last = r.chunk(None, finish="length")
    assert last["choices"][0] == {"index": 0, "delta": {}, "logprobs": None,
                                  "finish_reason": "length"}
    assert "usage" not in last
    usage = r.usage_chunk(stats())
    assert usage["choices"] == [] and usage["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
    assert {c["id"] for c in (first, last, usage)} == {r.id}
    assert sse({"a": 1}) == b'data: {"a":1}\n\n' and sse("[DONE]") == b"data: [DONE]\n\n"


# -- keys ----------------------------------------------------------------------------------

def test_keys_lookup_and_reload(tmp_path):
    path = write_keys(tmp_path / "keys.json", {"alice-key-123": {"tenant": "alice"},
                                               "bob-key-45678": {"tenant": "bob",
                                                                 "permission_version": 2}})
    keys = KeyStore(path)
    assert keys.required and keys.tenants == {"alice", "bob"}
    assert keys.lookup("alice-key-123") == Principal("alice", 0)
    assert keys.lookup("bob-key-45678") == Principal("bob", 2)
    assert keys.lookup("bob-key-4567") is None and keys.lookup(None) is None
    write_keys(path, {"alice-key-123": {"tenant": "alice", "permission_version": 1}})
    assert "1 keys" in keys.reload()
    assert keys.lookup("alice-key-123") == Principal("alice", 1)
    assert keys.lookup("bob-key-45678") is None
    path.write_text("{not json")
    with pytest.raises(KeysFileError, match="not valid JSON"):
        keys.reload()
    assert keys.lookup("alice-key-123") == Principal("alice", 1)  # the old table stays
    path.write_text("[" * 200_000 + "]" * 200_000)  # a hostile nesting bomb
    with pytest.raises(KeysFileError, match="nested too deeply"):
        keys.reload()
    assert keys.lookup("alice-key-123") == Principal("alice", 1)
    with pytest.raises(KeysFileError, match="nested too deeply"):
        KeyStore(path)


@pytest.mark.parametrize("table,needle", [
    ([], "non-empty JSON object"),
    ({}, "non-empty JSON object"),
    ({"key-12345": "alice"}, "expected"),
    ({"key-12345": {"tenant": ""}}, "tenant"),
    ({"key-12345": {"tenant": "a", "permission_version": -1}}, "permission_version"),
    ({"key-12345": {"tenant": "a", "scope": "all"}}, "expected"),
    ({" key-12345": {"tenant": "a"}}, "printable"),
])
def test_bad_keys_tables(tmp_path, table, needle):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps(table))
    path.chmod(0o600)
    with pytest.raises(KeysFileError, match=needle):
        KeyStore(path)


def test_keys_file_modes(tmp_path):
    table = {"alice-key-123": {"tenant": "alice"}}
    for mode in (0o644, 0o640, 0o604, 0o660):
        with pytest.raises(KeysFileError, match="0600"):
            KeyStore(write_keys(tmp_path / "k.json", table, mode=mode))
    assert KeyStore(write_keys(tmp_path / "k.json", table, mode=0o400)).required
    with pytest.raises(KeysFileError, match="regular file"):
        KeyStore(tmp_path)


def test_no_keys_file_is_the_local_tenant():
    keys = KeyStore(None)
    assert not keys.required and keys.lookup(None) == LOCAL and keys.lookup("x") == LOCAL


def test_bearer_key():
    assert bearer_key("Bearer abc") == "abc" and bearer_key("bearer  abc ") == "abc"
    assert bearer_key("Basic abc") is None and bearer_key("Bearer ") is None
    assert bearer_key(None) is None


def test_loopback_only_without_keys():
    for host in ("127.0.0.1", "::1", "localhost"):
        check_host(host, keys_required=False)
    with pytest.raises(KVChatError, match="loopback"):
        check_host("0.0.0.0", keys_required=False)
    check_host("0.0.0.0", keys_required=True)


# -- the event pump ---------------------------------------------------------------------------

class FakeHandle:
    """Events queued by a 'thread' (here: the test), read without blocking."""

    def __init__(self, request_id: int):
        self.request_id = request_id
        self.queue: list[GenerationEvent] = []
        self.cancels = 0
        self.done = False

    @property
    def ready(self) -> bool:
        return bool(self.queue)

    def poll(self):
        if not self.queue:
            return None
        event = self.queue.pop(0)
        self.done = event.finish_reason is not None
        return event

    def cancel(self) -> bool:
        self.cancels += 1
        return not self.done


async def test_pump_delivers_events_in_order():
    pump, h = EventPump(interval_s=0.001), FakeHandle(1)
    loop = asyncio.get_running_loop()
    for i, t in enumerate(["a", "b", "c"]):
        loop.call_later(0.01 * (i + 1), h.queue.append,
                        GenerationEvent(1, i, t, finish_reason="stop" if t == "c" else None))
    got = [e.text async for e in pump.events(h)]
    assert got == ["a", "b", "c"] and pump.num_live == 0


async def test_tokens_waiting_together_go_out_as_one_event():
    """A speculative step yields several tokens at once: one event (text joined), the
    final event kept apart from the tokens before it only when it came later."""
    pump, h = EventPump(interval_s=0.001), FakeHandle(3)
    h.queue += [GenerationEvent(3, 5, "Par"), GenerationEvent(3, 6, "is"),
                GenerationEvent(3, 7, " is")]
    loop = asyncio.get_running_loop()
    loop.call_later(0.02, h.queue.extend, [GenerationEvent(3, 8, " big"),
                                           GenerationEvent(3, None, ".", finish_reason="stop")])
    got = [(e.token, e.text, e.finish_reason) async for e in pump.events(h)]
    assert got == [(7, "Paris is", None), (None, " big.", "stop")]


async def test_joined_events_keep_every_tokens_logprobs():
    from engine.logprobs import TokenLogprob

    pump, h = EventPump(interval_s=0.001), FakeHandle(4)
    lp = {t: [TokenLogprob(t, -0.1 * t)] for t in (5, 6, 7)}
    h.queue += [GenerationEvent(4, 5, "a", logprobs=lp[5]), GenerationEvent(4, 6, "b"),
                GenerationEvent(4, 7, "c", logprobs=lp[7], finish_reason="stop")]
    h.queue[1].logprobs = lp[6]
    got = [e async for e in pump.events(h)]
    assert [x.token for e in got for x in e.logprobs] == [5, 6, 7]


async def test_leaving_early_cancels_and_reads_the_final_event():
    pump, h = EventPump(interval_s=0.001), FakeHandle(2)

    async def consume():
        async for _ in pump.events(h):
            pass

    task = asyncio.ensure_future(consume())
    await asyncio.sleep(0.01)
    assert pump.num_live == 1
    assert pump.cancel_all() == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert h.cancels == 2 and pump.num_live == 0  # cancel_all, then the consumer's exit
    # the engine's final event still comes: the pump reads it so nothing is left queued
    h.queue.append(GenerationEvent(2, None, "", finish_reason="cancelled",
                                   stats=RequestStats(release_latency_ms=12.5)))
    for _ in range(100):
        if h.done:
            break
        await asyncio.sleep(0.005)
    assert h.done and not h.queue


def test_n_logprobs_and_thinking_fields():
    p = parse_request("chat", {"messages": USER, "n": 3, "logprobs": True, "top_logprobs": 4})
    assert (p.n, p.logprobs) == (3, 4)
    assert parse_request("chat", {"messages": USER, "logprobs": True}).logprobs == 0
    assert parse_request("chat", {"messages": USER, "logprobs": False}).logprobs is None
    assert parse_request("text", {"prompt": "a", "logprobs": 5}).logprobs == 5
    assert parse_request("text", {"prompt": "a", "logprobs": 0}).logprobs == 0
    assert refused("text", {"prompt": "a", "logprobs": 21}).param == "logprobs"
    assert refused("text", {"prompt": "a", "logprobs": True}).param == "logprobs"
    efforts = {e: parse_request("chat", {"messages": USER, "reasoning_effort": e})
               for e in ("minimal", "low", "medium", "high")}
    budgets = [efforts[e].thinking_budget for e in ("minimal", "low", "medium", "high")]
    assert budgets == sorted(budgets) and len(set(budgets)) == 4
    assert efforts["low"].template_kwargs == {"reasoning_effort": "low"}
    given = parse_request("chat", {"messages": USER, "reasoning_effort": "high",
                                   "thinking_budget": 7})
    assert given.thinking_budget == 7  # an explicit budget wins over the effort's
    json_out = parse_request("chat", {"messages": USER, "reasoning_effort": "high",
                                      "response_format": {"type": "json_object"}})
    assert json_out.thinking_budget is None  # a grammar cannot take a forced </think>
    assert parse_request("text", {"prompt": "a", "thinking_budget": 0}).thinking_budget == 0
