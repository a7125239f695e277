"""`kvchat serve` through the official `openai` client (sync and async) on a real process.

One server for the module: the default model, three tenants by API key, a small KV pool
(64M: 91 blocks of 16 tokens), at most 4 running and 4 waiting (so the 429 is easy to hit),
prefill in 128-token chunks (so a cancel waits on a short step).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
import uuid

import httpx
import openai
import pytest
from openai import AsyncOpenAI, OpenAI
from test_server_process import ServerProcess, write_keys

pytestmark = pytest.mark.subprocess  # the server is a real `kvchat serve` process

ALICE, BOB, CAROL = "alice-key-0001", "bob-key-000002", "carol-key-0003"
KEYS = {ALICE: {"tenant": "alice"}, BOB: {"tenant": "bob"},
        CAROL: {"tenant": "carol", "permission_version": 0}}
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
PARIS = "The capital of France is Paris."


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve-api")
    keys = write_keys(tmp / "keys.json", KEYS)
    srv = ServerProcess(tmp, "--api-keys", str(keys), "--no-disk-cache", "--kv-budget", "64M",
                        "--max-running", "4", "--max-waiting", "4",
                        "--prefill-chunk", "128").start()
    srv.keys_path = keys
    yield srv
    assert srv.stop() == 0, srv.log()
    assert "stopped: 0 blocks in use" in srv.log()


def client(server, key: str = ALICE) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=120)


def cached(completion) -> int:
    return completion.usage.prompt_tokens_details.cached_tokens


def unique_chat(question: str) -> list[dict]:
    """Messages no earlier request began with (the chat template's own first block aside)."""
    return [{"role": "system", "content": f"Test session {uuid.uuid4().hex}."},
            {"role": "user", "content": question}]


def ask(server, messages: list[dict] | str, key: str = ALICE):
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    return client(server, key).chat.completions.create(
        model="kvchat", messages=messages, max_tokens=1, temperature=0)


def test_models(server):
    models = client(server).models.list().data
    assert len(models) == 1 and models[0].id and models[0].owned_by == "kvchat"


def test_answer_streams_and_usage_is_right(server):
    c = client(server)
    whole = c.chat.completions.create(model="kvchat", messages=FRANCE, temperature=0,
                                      max_tokens=20)
    assert whole.choices[0].message.content == PARIS
    assert whole.choices[0].finish_reason == "stop" and whole.object == "chat.completion"
    u = whole.usage
    assert u.prompt_tokens > 10 and 0 < u.completion_tokens <= 20
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    chunks = list(c.chat.completions.create(model="kvchat", messages=FRANCE, temperature=0,
                                            max_tokens=20, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    pieces = [ch.choices[0].delta.content for ch in chunks if ch.choices
              and ch.choices[0].delta.content]
    assert len(pieces) >= 5 and "".join(pieces) == PARIS  # it streamed, token by token
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "stop"
    assert chunks[-1].choices == [] and all(ch.usage is None for ch in chunks[:-1])
    su = chunks[-1].usage
    assert (su.prompt_tokens, su.completion_tokens) == (u.prompt_tokens, u.completion_tokens)
    assert su.prompt_tokens_details.cached_tokens >= 16  # the same prompt, a second time


def test_completions_endpoint_counts_tokens(server):
    c = client(server)
    ids = list(range(1000, 1040))
    r = c.completions.create(model="kvchat", prompt=ids, max_tokens=4, temperature=0)
    assert r.object == "text_completion" and r.usage.prompt_tokens == 40
    assert r.usage.completion_tokens == 4 or r.choices[0].finish_reason == "stop"
    text = [ch.choices[0].text for ch in c.completions.create(
        model="kvchat", prompt="Once upon a time", max_tokens=6, temperature=0, stream=True)
        if ch.choices]
    assert len(text) >= 2 and "".join(text)


async def test_async_client_streams_and_not(server):
    c = AsyncOpenAI(base_url=f"{server.url}/v1", api_key=BOB, max_retries=0, timeout=120)

    async def streamed() -> str:
        stream = await c.chat.completions.create(model="kvchat", messages=FRANCE,
                                                 temperature=0, max_tokens=20, stream=True)
        return "".join([ch.choices[0].delta.content or "" async for ch in stream
                        if ch.choices])

    whole, text = await asyncio.gather(
        c.chat.completions.create(model="kvchat", messages=FRANCE, temperature=0,
                                  max_tokens=20), streamed())
    assert whole.choices[0].message.content == text == PARIS
    await c.close()


def test_second_turn_reports_cached_tokens(server):
    system = f"You are test assistant {uuid.uuid4().hex}. Answer in one short sentence."
    turn1 = [{"role": "system", "content": system},
             {"role": "user", "content": "Name a primary colour."}]
    c = client(server)
    r1 = c.chat.completions.create(model="kvchat", messages=turn1, max_tokens=12,
                                   temperature=0)
    assert cached(r1) == 0
    turn2 = turn1 + [{"role": "assistant", "content": r1.choices[0].message.content},
                     {"role": "user", "content": "And another one?"}]
    r2 = c.chat.completions.create(model="kvchat", messages=turn2, max_tokens=12,
                                   temperature=0)
    assert cached(r2) >= 16 and cached(r2) <= r1.usage.total_tokens
    assert r2.model_extra["kvchat"]["cache_source"] == "memory"


def test_bad_or_missing_key_is_401(server):
    with pytest.raises(openai.AuthenticationError) as info:
        client(server, "wrong-key-1234").chat.completions.create(model="kvchat",
                                                                 messages=FRANCE)
    assert info.value.status_code == 401 and info.value.code == "invalid_api_key"
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": FRANCE})
    assert r.status_code == 401 and "missing API key" in r.json()["error"]["message"]
    assert httpx.get(f"{server.url}/v1/models").status_code == 401
    assert httpx.get(f"{server.url}/health").status_code == 200  # open: no secrets in it


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def test_bad_requests_get_clear_4xx_and_the_server_keeps_serving(server):
    url, auth = f"{server.url}/v1/chat/completions", {"Authorization": f"Bearer {ALICE}"}
    err = error_of(httpx.post(url, content=b'{"messages": [', headers=auth), 400)
    assert "not valid JSON" in err["message"]
    error_of(httpx.post(url, json=[1, 2], headers=auth), 400)
    error_of(httpx.post(url, content=b"x" * (9 << 20), headers=auth, timeout=60), 413)
    error_of(httpx.get(url, headers=auth), 405)
    error_of(httpx.get(f"{server.url}/v1/nothing", headers=auth), 404)
    c = client(server)
    with pytest.raises(openai.BadRequestError) as info:
        c.chat.completions.create(model="kvchat", messages=FRANCE, extra_body={"frobnicate": 1})
    assert (info.value.code, info.value.param) == ("unknown_parameter", "frobnicate")
    with pytest.raises(openai.BadRequestError) as info:
        c.chat.completions.create(model="kvchat", messages=FRANCE, n=99)
    assert info.value.param == "n"  # past the server's --max-n (8)
    huge = [{"role": "user", "content": "hello " * 50_000}]  # refused before tokenizing
    with pytest.raises(openai.BadRequestError) as info:
        c.chat.completions.create(model="kvchat", messages=huge)
    assert info.value.code == "context_length_exceeded"
    # > the 64 MiB pool: 2,912 tokens of float16 K/V (the CPU extension's path), 1,456 float32
    beyond_pool = [{"role": "user", "content": "hello " * 3200}]
    with pytest.raises(openai.BadRequestError) as info:
        c.chat.completions.create(model="kvchat", messages=beyond_pool)
    assert info.value.code == "context_length_exceeded" and "KV pool" in info.value.message
    assert ask(server, "Still there?").choices[0].finish_reason in ("stop", "length")
    assert server.metrics()["kvchat_rejections_total"] >= 1


def test_reduced_max_tokens_is_reported(server):
    raw = client(server).chat.completions.with_raw_response.create(
        model="kvchat", messages=FRANCE, max_tokens=100_000, temperature=0)
    assert "max_tokens reduced from 100000" in raw.headers["x-kvchat-notice"]
    r = raw.parse()
    granted = r.model_extra["kvchat"]["max_tokens"]
    assert granted < 100_000 and int(raw.headers["x-kvchat-max-tokens"]) == granted
    assert r.model_extra["kvchat"]["notice"] == raw.headers["x-kvchat-notice"]
    assert r.choices[0].message.content == PARIS


def shared_blocks_while_both_run(server, key1: str, key2: str, messages) -> float:
    """/metrics' shared blocks at a moment both streams are seen running.

    A reading taken after one stream ended (an early EOS) would make either assertion on it
    vacuous, so the reading counts only when /metrics shows both running."""
    for _ in range(3):
        streams = []
        for key in (key1, key2):
            streams.append(client(server, key).chat.completions.create(
                model="kvchat", messages=messages, max_tokens=400, temperature=0, stream=True))
            first_text(streams[-1])
        m = server.metrics()
        for s in streams:
            s.close()
        if m['kvchat_requests{state="running"}'] == 2:
            return m['kvchat_kv_blocks{state="shared"}']
        server.wait_idle()
    raise AssertionError("the two streams were never seen running at once")


def first_text(stream) -> str:
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            return chunk.choices[0].delta.content
    raise AssertionError("the stream ended without text")


def test_two_tenants_never_share_blocks(server):
    text = unique_chat("Write a long story about a lighthouse keeper and a storm.")
    assert cached(ask(server, text, ALICE)) == 0
    assert cached(ask(server, text, ALICE)) >= 32  # alice's own blocks
    assert cached(ask(server, text, BOB)) == 0  # identical text, other tenant: a miss
    assert cached(ask(server, text, BOB)) >= 32
    assert shared_blocks_while_both_run(server, ALICE, ALICE, text) > 0  # the control
    assert shared_blocks_while_both_run(server, ALICE, BOB, text) == 0
    m = server.wait_idle()
    assert m['kvchat_kv_blocks{state="used"}'] == 0


def test_permission_bump_on_sighup_makes_old_blocks_unreachable(server):
    text = unique_chat("What colour is the sky on a clear day?")
    ask(server, text, CAROL)
    assert cached(ask(server, text, CAROL)) >= 32
    write_keys(server.keys_path, {**KEYS, CAROL: {"tenant": "carol", "permission_version": 1}})
    before = server.log().count("reloaded")
    server.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while server.log().count("reloaded") == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.log().count("reloaded") > before
    assert cached(ask(server, text, CAROL)) == 0  # the old scope's blocks are unreachable
    assert cached(ask(server, text, CAROL)) >= 32
    assert cached(ask(server, text, ALICE)) == 0


def test_disconnect_during_prefill_and_decode_frees_blocks(server):
    before = server.metrics()
    c = client(server)
    fox = "the quick brown fox jumps over the lazy dog " * 80  # ~800 tokens
    stream = c.chat.completions.create(model="kvchat", max_tokens=50, stream=True,
                                       messages=[{"role": "user", "content": fox}])
    next(iter(stream))  # the role chunk comes at once; the ~800-token prefill has begun
    time.sleep(0.3)
    assert server.metrics()['kvchat_kv_blocks{state="used"}'] > 0
    stream.close()  # the client goes away mid-prefill
    # raw text that the model goes on repeating: these two are still decoding when they leave
    decoding = c.completions.create(model="kvchat", prompt=fox[:400], max_tokens=200,
                                    temperature=0, stream=True)
    assert next(ch for ch in decoding if ch.choices and ch.choices[0].text)
    decoding.close()  # ... one mid-decode
    with contextlib.suppress(httpx.ReadTimeout):  # a non-streaming client gives up waiting
        httpx.post(f"{server.url}/v1/completions", timeout=0.5,
                   headers={"Authorization": f"Bearer {ALICE}"},
                   json={"prompt": fox[:1500], "max_tokens": 200, "temperature": 0})
    m = server.wait_idle()
    assert m['kvchat_kv_blocks{state="used"}'] == 0 and m['kvchat_requests{state="running"}'] == 0
    assert m["kvchat_client_disconnects_total"] - before["kvchat_client_disconnects_total"] == 3
    cancelled = 'kvchat_requests_finished_total{reason="cancelled"}'
    assert m[cancelled] - before.get(cancelled, 0) == 3
    samples = "kvchat_cancel_release_latency_ms_samples"
    assert m[samples] - before[samples] == 3  # each cancel's release was measured


async def test_full_queue_gets_429_with_retry_after(server):
    c = AsyncOpenAI(base_url=f"{server.url}/v1", api_key=ALICE, max_retries=0, timeout=120)
    text = "Describe the sea. " * 20
    results = await asyncio.gather(*[
        c.chat.completions.create(model="kvchat", max_tokens=2,
                                  messages=[{"role": "user", "content": f"{i} {text}"}])
        for i in range(16)], return_exceptions=True)
    await c.close()
    limited = [r for r in results if isinstance(r, openai.RateLimitError)]
    ok = [r for r in results if not isinstance(r, Exception)]
    assert len(limited) + len(ok) == 16, [r for r in results if isinstance(r, Exception)]
    assert limited and len(ok) >= 4
    assert limited[0].response.headers["retry-after"] == "1"
    assert limited[0].code == "rate_limit_exceeded"
    assert server.wait_idle()['kvchat_kv_blocks{state="used"}'] == 0


def test_metrics_and_health(server):
    ask(server, unique_chat("Say hi."))  # a request of its own: the latencies have samples
    m = server.metrics()
    for name in ['kvchat_kv_blocks{state="free"}', 'kvchat_kv_blocks{state="used"}',
                 'kvchat_kv_blocks{state="cached"}', 'kvchat_requests{state="waiting"}',
                 'kvchat_requests{state="running"}', "kvchat_preemptions_total",
                 "kvchat_rejections_total", "kvchat_prefix_hit_rate",
                 "kvchat_prefix_cached_tokens_total", "kvchat_release_latency_last_ms",
                 "kvchat_kv_used_bytes", "kvchat_kv_peak_bytes", "kvchat_evictions_total",
                 "kvchat_active_sequences", "process_resident_memory_bytes"]:
        assert name in m, name
    for base in ("ttft_seconds", "itl_seconds", "prefill_tokens_per_second",
                 "decode_tokens_per_second", "release_latency_ms"):
        for q in ("0.5", "0.95", "0.99"):
            assert f'kvchat_{base}{{quantile="{q}"}}' in m
    assert m['kvchat_ttft_seconds{quantile="0.95"}'] > 0
    health = httpx.get(f"{server.url}/health").json()
    assert health["status"] == "ok" and health["blocks_used"] == 0


def test_response_format_json_schema_validates_and_bad_schemas_are_400(server):
    import json

    import jsonschema

    schema = {"type": "object", "properties": {
        "capital": {"type": "string", "maxLength": 20},
        "population_millions": {"type": "number", "minimum": 0, "maximum": 50}},
        "required": ["capital", "population_millions"], "additionalProperties": False}
    c = client(server)
    r = c.chat.completions.create(model="kvchat", messages=FRANCE, max_tokens=60, temperature=0,
                                  response_format={"type": "json_schema", "json_schema": {
                                      "name": "city", "strict": True, "schema": schema}})
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    stream = c.chat.completions.create(model="kvchat", messages=FRANCE, max_tokens=60,
                                       stream=True, response_format={"type": "json_object"})
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert text.startswith("{")
    with pytest.raises(openai.BadRequestError) as info:  # compiles only at submit
        c.chat.completions.create(model="kvchat", messages=FRANCE, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}})
    assert info.value.param == "response_format" and "invalid json_schema" in info.value.message
    assert ask(server, "Still there?").choices[0].finish_reason in ("stop", "length")


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                   "required": ["city"], "additionalProperties": False}}}
WEATHER_Q = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_tool_calls_required_streamed_and_an_agent_loop(server):
    import json

    import jsonschema

    c = client(server)
    params = WEATHER_TOOL["function"]["parameters"]
    r = c.chat.completions.create(model="kvchat", messages=WEATHER_Q, tools=[WEATHER_TOOL],
                                  tool_choice="required", max_tokens=60, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), params)
    # streamed: the call comes as tool_calls deltas, never as content
    stream = c.chat.completions.create(model="kvchat", messages=WEATHER_Q, tools=[WEATHER_TOOL],
                                       tool_choice={"type": "function",
                                                    "function": {"name": "get_weather"}},
                                       max_tokens=60, temperature=0.7, seed=3, stream=True)
    deltas, content, finish = [], "", None
    for chunk in stream:
        d = chunk.choices[0].delta
        content += d.content or ""
        deltas += d.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and "<tool_call>" not in content
    assert deltas[0].function.name == "get_weather"
    jsonschema.validate(json.loads(deltas[0].function.arguments), params)
    # the loop: the tool's result goes back, the model answers (tools still offered)
    history = WEATHER_Q + [choice.message.model_dump(exclude_none=True),
                           {"role": "tool", "tool_call_id": call.id,
                            "content": '{"temp_c": 18, "sky": "sunny"}'}]
    final = c.chat.completions.create(model="kvchat", messages=history, tools=[WEATHER_TOOL],
                                      max_tokens=40, temperature=0)
    assert final.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert final.usage.prompt_tokens > r.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as info:
        c.chat.completions.create(model="kvchat", messages=WEATHER_Q, tools=[WEATHER_TOOL],
                                  tool_choice={"type": "function",
                                               "function": {"name": "launch"}})
    assert info.value.param == "tool_choice"
    assert ask(server, "Still there?").choices[0].finish_reason in ("stop", "length")


def test_template_switches_reach_the_template_and_answers_stay_plain(server):
    r = client(server).chat.completions.create(
        model="kvchat", messages=FRANCE, max_tokens=12, temperature=0, reasoning_effort="low",
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    msg = r.choices[0].message
    assert msg.content and getattr(msg, "reasoning_content", None) is None  # no think tags
    plain = ask(server, FRANCE)
    assert r.usage.prompt_tokens == plain.usage.prompt_tokens  # same rendered prompt


def test_anthropic_messages_whole_streamed_tools_and_errors(server):
    import json

    import anthropic

    GREEDY = {"temperature": 0}  # (this SDK has no temperature argument)
    c = anthropic.Anthropic(base_url=server.url, api_key=ALICE, max_retries=0, timeout=120)
    system = f"Session {uuid.uuid4().hex}. Be brief."
    m = c.messages.create(model="kvchat", max_tokens=16, system=system, extra_body=GREEDY,
                          messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert m.type == "message" and m.role == "assistant" and m.content[0].type == "text"
    assert m.stop_reason in ("end_turn", "max_tokens") and m.usage.output_tokens >= 1
    # the same prompt again: its blocks come from the prefix cache
    again = c.messages.create(model="kvchat", max_tokens=16, system=system, extra_body=GREEDY,
                              messages=[{"role": "user",
                                         "content": "What is the capital of France?"}])
    assert again.usage.cache_read_input_tokens > 0
    assert again.content[0].text == m.content[0].text
    with c.messages.stream(model="kvchat", max_tokens=16, system=system, extra_body=GREEDY,
                           messages=[{"role": "user", "content": "What is the capital of "
                                      "France?"}]) as s:
        kinds = [e.type for e in s]
        text = s.get_final_message().content[0].text
    assert text == m.content[0].text
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds.index("content_block_start") < kinds.index("content_block_stop") \
        < kinds.index("message_delta")
    word = m.content[0].text.split()[2]  # a stop sequence the greedy answer reaches
    for stream in (False, True):
        kw = dict(model="kvchat", max_tokens=16, system=system, extra_body=GREEDY,
                  stop_sequences=["never here", word],
                  messages=[{"role": "user", "content": "What is the capital of France?"}])
        if stream:
            with c.messages.stream(**kw) as s:
                cut = s.get_final_message()
        else:
            cut = c.messages.create(**kw)
        assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", word), stream
        assert cut.content[0].text == m.content[0].text[:m.content[0].text.index(word)]
    tool = {"name": "get_weather", "description": "Weather in a city", "input_schema": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
        "required": ["city"]}}
    q = [{"role": "user", "content": "What is the weather in Paris?"}]
    t = c.messages.create(model="kvchat", max_tokens=60, tools=[tool], messages=q,
                          tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY)
    use = [b for b in t.content if b.type == "tool_use"][0]
    assert t.stop_reason == "tool_use" and use.name == "get_weather" and "city" in use.input
    follow = q + [{"role": "assistant", "content": [b.model_dump() for b in t.content]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                "content": json.dumps({"temp_c": 18})}]}]
    done = c.messages.create(model="kvchat", max_tokens=30, tools=[tool], messages=follow)
    assert done.stop_reason in ("end_turn", "max_tokens", "tool_use")
    with pytest.raises(anthropic.BadRequestError) as info:
        c.messages.create(model="kvchat", max_tokens=8, messages=[{"role": "bot",
                                                                    "content": "x"}])
    assert info.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="nope", max_retries=0).messages.create(
            model="kvchat", max_tokens=8, messages=q)
    assert ask(server, "Still there?").choices[0].finish_reason in ("stop", "length")


def test_responses_api_equals_chat_completions_streamed_and_whole(server):
    c = client(server)
    question = unique_chat("Name one planet.")
    chat = c.chat.completions.create(model="kvchat", messages=question, max_tokens=16,
                                     temperature=0).choices[0].message.content
    r = c.responses.create(model="kvchat", instructions=question[0]["content"],
                           input=question[1]["content"], max_output_tokens=16, temperature=0)
    assert r.output_text == chat and r.status in ("completed", "incomplete")
    assert r.usage.input_tokens_details.cached_tokens > 0  # the chat request's blocks
    kinds, text = [], ""
    for e in c.responses.create(model="kvchat", instructions=question[0]["content"],
                                input=[{"role": "user", "content": question[1]["content"]}],
                                max_output_tokens=16, temperature=0, stream=True):
        kinds.append(e.type)
        text += getattr(e, "delta", "") if e.type == "response.output_text.delta" else ""
    assert text == chat
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert kinds.index("response.output_item.added") < kinds.index("response.output_text.delta")
    tool = {"type": "function", "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
        "required": ["city"]}}
    t = c.responses.create(model="kvchat", input="Weather in Paris?", tools=[tool],
                           tool_choice="required", max_output_tokens=60, temperature=0.7)
    call = [o for o in t.output if o.type == "function_call"][0]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    done = c.responses.create(model="kvchat", tools=[tool], max_output_tokens=20, input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name,
         "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp_c": 18}'}])
    assert done.status in ("completed", "incomplete")
    with pytest.raises(openai.BadRequestError) as info:
        c.responses.create(model="kvchat", input="hi", store=True)
    assert info.value.param == "store"
