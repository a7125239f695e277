"""Issue 29's acceptance check for structured output: 50 requests over 10 JSON schemas
(nested objects, enums, arrays, numbers with ranges) through the official `openai` and
`anthropic` clients (sync, async, streaming) against a real `kvchat serve`; every answer
must parse and validate with `jsonschema`, and no block may stay in use."""

from __future__ import annotations

import asyncio
import json

import anthropic
import httpx
import jsonschema
import pytest
from openai import AsyncOpenAI, OpenAI
from test_server_process import ServerProcess

pytestmark = pytest.mark.subprocess  # the server is a real `kvchat serve` process

_NAME = {"type": "string", "minLength": 1, "maxLength": 16}
SCHEMAS = {
    "person": {"type": "object", "properties": {
        "name": _NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"], "additionalProperties": False},
    "color": {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]}, "bright": {"type": "boolean"}},
        "required": ["color", "bright"], "additionalProperties": False},
    "tags": {"type": "object", "properties": {
        "tags": {"type": "array", "items": _NAME, "minItems": 1, "maxItems": 3}},
        "required": ["tags"], "additionalProperties": False},
    "address": {"type": "object", "properties": {
        "street": _NAME, "city": {"type": "object", "properties": {
            "name": _NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["name", "zip"], "additionalProperties": False}},
        "required": ["street", "city"], "additionalProperties": False},
    "reading": {"type": "object", "properties": {
        "celsius": {"type": "number", "minimum": -50, "maximum": 60},
        "humidity": {"type": "integer", "minimum": 0, "maximum": 100}},
        "required": ["celsius", "humidity"], "additionalProperties": False},
    "order": {"type": "object", "properties": {
        "items": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
            "type": "object", "properties": {
                "sku": {"enum": ["A1", "B2", "C3"]},
                "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["sku", "qty"], "additionalProperties": False}}},
        "required": ["items"], "additionalProperties": False},
    "answer": {"type": "object", "properties": {
        "ok": {"type": "boolean"}, "code": {"type": "integer", "enum": [200, 404, 500]}},
        "required": ["ok", "code"], "additionalProperties": False},
    "point": {"type": "object", "properties": {
        "x": {"type": "number", "minimum": 0, "maximum": 10},
        "y": {"type": "number", "minimum": 0, "maximum": 10}},
        "required": ["x", "y"], "additionalProperties": False},
    "grid": {"type": "object", "properties": {
        "rows": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
            "type": "array", "minItems": 1, "maxItems": 3,
            "items": {"type": "integer", "minimum": 0, "maximum": 9}}}},
        "required": ["rows"], "additionalProperties": False},
    "book": {"type": "object", "properties": {
        "title": _NAME, "year": {"type": "integer", "minimum": 1450, "maximum": 2030},
        "genre": {"enum": ["fiction", "history", "science"]},
        "author": {"type": "object", "properties": {"first": _NAME, "last": _NAME},
                   "required": ["first", "last"], "additionalProperties": False}},
        "required": ["title", "year", "genre", "author"], "additionalProperties": False},
}
ASKS = ["Give one example {} as JSON.", "Make up a {}.", "Describe a {} in JSON.",
        "Write a {} record.", "Return a sample {}."]
MAX_TOKENS = 200


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(tmp_path_factory.mktemp("serve-schemas"), "--no-disk-cache",
                        "--kv-budget", "64M", "--max-running", "8").start()
    yield srv
    assert srv.stop() == 0, srv.log()
    assert "stopped: 0 blocks in use" in srv.log()


def _messages(name: str, i: int) -> list[dict]:
    return [{"role": "user", "content": ASKS[i].format(name)}]


def _format(name: str) -> dict:
    return {"type": "json_schema",
            "json_schema": {"name": name, "strict": True, "schema": SCHEMAS[name]}}


def _check(name: str, text: str, finish: str) -> None:
    assert finish in ("stop", "end_turn", "tool_use"), (name, finish, text)  # not cut
    jsonschema.validate(json.loads(text) if isinstance(text, str) else text, SCHEMAS[name])


def test_fifty_schema_requests_all_validate(server):
    names = list(SCHEMAS)
    sync = OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=300)
    done = 0
    for name in names:  # 10 whole answers, sync
        r = sync.chat.completions.create(model="kvchat", messages=_messages(name, 0),
                                         max_tokens=MAX_TOKENS, temperature=0,
                                         response_format=_format(name))
        _check(name, r.choices[0].message.content, r.choices[0].finish_reason)
        done += 1
    for name in names:  # 10 streamed, sync
        stream = sync.chat.completions.create(
            model="kvchat", messages=_messages(name, 1), max_tokens=MAX_TOKENS, temperature=0,
            response_format=_format(name), stream=True)
        text, finish = "", None
        for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
        _check(name, text, finish)
        done += 1

    async def concurrent():  # 20 at once, whole and streamed: one batch of mixed schemas
        client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0,
                             timeout=300)

        async def whole(name):
            r = await client.chat.completions.create(
                model="kvchat", messages=_messages(name, 2), max_tokens=MAX_TOKENS,
                temperature=0, response_format=_format(name))
            return name, r.choices[0].message.content, r.choices[0].finish_reason

        async def streamed(name):
            stream = await client.chat.completions.create(
                model="kvchat", messages=_messages(name, 3), max_tokens=MAX_TOKENS,
                temperature=0, response_format=_format(name), stream=True)
            text, finish = "", None
            async for chunk in stream:
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
                    finish = chunk.choices[0].finish_reason or finish
            return name, text, finish

        return await asyncio.gather(*[whole(n) for n in names], *[streamed(n) for n in names])

    for name, text, finish in asyncio.run(concurrent()):
        _check(name, text, finish)
        done += 1
    claude = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=300)
    for name in names:  # 10 through Anthropic's forced tool use: input_schema is the schema
        msg = claude.messages.create(
            model="kvchat", max_tokens=MAX_TOKENS, messages=_messages(name, 4),
            tools=[{"name": name, "description": f"Record a {name}",
                    "input_schema": SCHEMAS[name]}],
            tool_choice={"type": "tool", "name": name})
        calls = [b for b in msg.content if b.type == "tool_use"]
        assert len(calls) == 1 and calls[0].name == name, msg
        _check(name, calls[0].input, msg.stop_reason)
        done += 1
    assert done == 50
    health = httpx.get(f"{server.url}/health").json()
    assert health["blocks_used"] == 0
