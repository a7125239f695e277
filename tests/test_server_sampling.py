"""`kvchat serve` through the official `openai` client: logprobs / top_logprobs, n answers
sharing the prompt's blocks, and the thinking budget, whole and streamed.

One server for the module: the default model, a 64 MiB pool (16-token blocks), at most
4 answers per request (``--max-n 4``) so the limit is easy to pass.
"""

from __future__ import annotations

import math
import threading
import time
import uuid

import httpx
import openai
import pytest
from openai import OpenAI
from test_server_process import ServerProcess

pytestmark = pytest.mark.subprocess

BLOCK = 16
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(tmp_path_factory.mktemp("serve-sampling"), "--no-disk-cache",
                        "--kv-budget", "64M", "--max-running", "8", "--max-n", "4").start()
    yield srv
    assert srv.stop() == 0, srv.log()
    assert "stopped: 0 blocks in use" in srv.log()


def client(server) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key="local", max_retries=0, timeout=300)


def check_entries(entries, k: int, greedy: bool) -> None:
    for e in entries:
        assert e.logprob <= 0 and len(e.top_logprobs) == k
        tops = [t.logprob for t in e.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        assert bytes(e.bytes).decode("utf-8", "replace") == e.token
        if greedy:  # the chosen token is the most likely one
            assert (e.top_logprobs[0].token, e.top_logprobs[0].logprob) == (e.token, e.logprob)
        else:
            assert e.logprob <= tops[0] + 1e-6


def test_chat_logprobs_whole_and_streamed(server):
    c = client(server)
    whole = c.chat.completions.create(model="kvchat", messages=FRANCE, temperature=0,
                                      max_tokens=10, logprobs=True, top_logprobs=3)
    choice = whole.choices[0]
    entries = choice.logprobs.content
    # one entry per generated token (the end-of-sequence token is not listed)
    assert len(entries) == whole.usage.completion_tokens - (choice.finish_reason == "stop")
    assert b"".join(bytes(e.bytes) for e in entries).decode() == choice.message.content
    check_entries(entries, 3, greedy=True)
    chunks = list(c.chat.completions.create(model="kvchat", messages=FRANCE, temperature=0,
                                            max_tokens=10, logprobs=True, top_logprobs=3,
                                            stream=True))
    streamed = [e for ch in chunks if ch.choices and ch.choices[0].logprobs
                for e in ch.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in entries]
    assert all(abs(a.logprob - b.logprob) < 1e-4 for a, b in zip(streamed, entries,
                                                                 strict=True))
    plain = c.chat.completions.create(model="kvchat", messages=FRANCE, temperature=0,
                                      max_tokens=10)
    assert plain.choices[0].logprobs is None
    assert plain.choices[0].message.content == choice.message.content
    sampled = c.chat.completions.create(model="kvchat", messages=FRANCE, temperature=1.2,
                                        seed=4, max_tokens=10, logprobs=True, top_logprobs=5)
    check_entries(sampled.choices[0].logprobs.content, 5, greedy=False)


def test_completions_legacy_logprobs(server):
    c = client(server)
    r = c.completions.create(model="kvchat", prompt="The three primary colours are",
                             max_tokens=8, temperature=0, logprobs=2)
    lp, text = r.choices[0].logprobs, r.choices[0].text
    # the streaming detokenizer drops the first token's leading space from the text
    assert "".join(lp.tokens).lstrip() == text.lstrip() and text
    assert len(lp.tokens) == len(lp.token_logprobs)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for tok, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 1 <= len(top) <= 2 and max(top.values()) == value and top[tok] == value
    pieces = [ch.choices[0] for ch in c.completions.create(
        model="kvchat", prompt="The three primary colours are", max_tokens=8, temperature=0,
        logprobs=2, stream=True) if ch.choices]
    tokens = [t for p in pieces if p.logprobs for t in p.logprobs.tokens]
    offsets = [o for p in pieces if p.logprobs for o in p.logprobs.text_offset]
    assert tokens == lp.tokens and offsets == lp.text_offset


def long_chat() -> list[dict]:
    facts = " ".join(f"Fact {i}: the number {i} is written as {i * 7}." for i in range(25))
    return [{"role": "system", "content": f"Session {uuid.uuid4().hex}. {facts}"},
            {"role": "user", "content": "Tell me a short story about a cat."}]


def test_n_samples_share_the_prompt_and_count_it_once(server):
    c = client(server)
    messages, peak, stop = long_chat(), [0], threading.Event()

    def watch():
        while not stop.is_set():
            peak[0] = max(peak[0], httpx.get(f"{server.url}/health").json()["blocks_used"])
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        r = c.chat.completions.create(model="kvchat", messages=messages, n=3, temperature=1.0,
                                      seed=11, max_tokens=24, logprobs=True)
    finally:
        stop.set()
        watcher.join()
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    assert all(ch.finish_reason in ("stop", "length") for ch in r.choices)
    assert len({ch.message.content for ch in r.choices}) >= 2  # each its own random stream
    counted = sum(len(ch.logprobs.content) + (ch.finish_reason == "stop") for ch in r.choices)
    assert r.usage.completion_tokens == counted  # summed over the answers
    prompt = r.usage.prompt_tokens
    assert r.usage.total_tokens == prompt + counted  # the prompt counted once
    cached = r.model_extra["kvchat"]["samples_cached_tokens"]
    assert all(n >= prompt - BLOCK for n in cached[1:])  # samples 1, 2 read sample 0's blocks
    prompt_blocks = math.ceil(prompt / BLOCK)
    own = math.ceil(24 / BLOCK) + 1  # each answer's own blocks (and its copy of the last)
    assert prompt_blocks > 3 * own  # so n copies of the prompt could not pass unseen
    assert 0 < peak[0] <= prompt_blocks + 3 * own < 3 * prompt_blocks, peak
    assert server.wait_idle()['kvchat_kv_blocks{state="used"}'] == 0
    greedy = c.chat.completions.create(model="kvchat", messages=FRANCE, n=2, temperature=0,
                                       max_tokens=8)
    assert greedy.choices[0].message.content == greedy.choices[1].message.content


def test_n_streamed_interleaves_choices_and_a_disconnect_frees_all(server):
    c = client(server)
    chunks = list(c.chat.completions.create(model="kvchat", messages=long_chat(), n=3,
                                            temperature=1.0, max_tokens=16, stream=True,
                                            stream_options={"include_usage": True}))
    by_index: dict[int, list] = {}
    for ch in chunks:
        for choice in ch.choices:
            by_index.setdefault(choice.index, []).append(choice)
    assert sorted(by_index) == [0, 1, 2]
    order = [ch.choices[0].index for ch in chunks if ch.choices and ch.choices[0].delta.content]
    switches = sum(a != b for a, b in zip(order, order[1:], strict=False))
    assert switches > 2  # interleaved as they come, not one answer after another
    for choices in by_index.values():
        assert choices[0].delta.role == "assistant"
        assert [x.finish_reason for x in choices if x.finish_reason] in (["stop"], ["length"])
    assert chunks[-1].usage.completion_tokens >= 3
    before = server.metrics().get("kvchat_client_disconnects_total", 0)
    body = {"messages": long_chat(), "n": 3, "max_tokens": 400, "temperature": 1.0,
            "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body,
                      timeout=120) as resp:
        seen = set()
        for line in resp.iter_lines():
            if '"content"' in line and '"index":2' in line:
                seen.add(2)
                break  # sample 2 is decoding: all three hold blocks; leave
    assert seen == {2}
    m = server.wait_idle()
    assert m['kvchat_kv_blocks{state="used"}'] == 0
    assert m['kvchat_requests{state="running"}'] == 0
    assert m.get("kvchat_client_disconnects_total", before + 1) >= before + 1


def test_bad_values_are_400_in_openai_shape(server):
    c = client(server)
    cases = [({"n": 0}, "n"), ({"n": 5}, "n"), ({"logprobs": True, "top_logprobs": 21},
                                                  "top_logprobs"),
             ({"extra_body": {"logprobs": "yes"}}, "logprobs"),
             ({"extra_body": {"thinking_budget": -2}}, "thinking_budget")]
    for fields, param in cases:
        with pytest.raises(openai.BadRequestError) as info:
            c.chat.completions.create(model="kvchat", messages=FRANCE, max_tokens=2, **fields)
        assert info.value.param == param and info.value.status_code == 400
        assert set(info.value.body) >= {"message", "type", "param", "code"}
    with pytest.raises(openai.BadRequestError) as info:
        c.completions.create(model="kvchat", prompt="a", logprobs=21, max_tokens=2)
    assert info.value.param == "logprobs"
    assert server.wait_idle()['kvchat_kv_blocks{state="used"}'] == 0


def test_thinking_budget_closes_an_open_think(server):
    """A raw prompt that leaves <think> open: after ``thinking_budget`` tokens the server
    forces ``</think>`` (the legacy logprobs list every token, so they can be counted)."""
    c = client(server)
    for budget in (3, 9):
        r = c.completions.create(model="kvchat", prompt="Solve 12 * 7. <think>\n",
                                 max_tokens=budget + 12, temperature=0, logprobs=0,
                                 extra_body={"thinking_budget": budget})
        tokens = r.choices[0].logprobs.tokens
        assert "</think>" not in "".join(tokens[:budget])
        assert "".join(tokens[budget:]).startswith("\n</think>\n\n")
    free = c.completions.create(model="kvchat", prompt="Solve 12 * 7. <think>\n",
                                max_tokens=12, temperature=0)
    assert "</think>" not in free.choices[0].text  # unforced, it does not close this soon
