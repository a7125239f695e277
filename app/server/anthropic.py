"""Anthropic's Messages API, ``POST /v1/messages``, over the same engine, tenants and limits.

The body is translated into the chat request kvchat already serves (`openai_schema`):
``system`` (text or text blocks), ``messages`` with text, ``tool_use`` and ``tool_result``
blocks, ``max_tokens`` (required, as Anthropic's), ``stop_sequences``, ``temperature``,
``top_p``, ``top_k``, ``tools`` (``input_schema``) and ``tool_choice`` (auto, any, tool,
none). Answers come back as content blocks with ``stop_reason`` and a ``usage`` whose
``cache_read_input_tokens`` are the prompt tokens the prefix cache served; streams send
Anthropic's events in their documented order. Errors take Anthropic's shape. The key may
come as ``x-api-key`` or as a bearer token.
"""

from __future__ import annotations

import json
import secrets

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from app.server import serving, tool_calls
from app.server.errors import APIError, invalid
from app.server.openai_schema import parse_request
from app.server.request_in import _state, authenticate, read_json
from app.server.streaming import EventStreamResponse

FIELDS = {"model", "max_tokens", "messages", "system", "stop_sequences", "temperature",
          "top_p", "top_k", "stream", "tools", "tool_choice", "metadata"}
STOP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def error_response(e: APIError) -> JSONResponse:
    """An `APIError` in Anthropic's shape."""
    kind = ERROR_TYPES.get(e.status, "api_error")
    return JSONResponse({"type": "error", "error": {"type": kind, "message": e.message}},
                        status_code=e.status, headers=e.headers)


def _text(param: str, content) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"{param} must be a string or a list of content blocks", param)
    parts = []
    for i, b in enumerate(content):
        if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"),
                                                                                 str):
            raise invalid(f"{param}[{i}] must be a text block", f"{param}[{i}]")
        parts.append(b["text"])
    return "".join(parts)


def _messages(value) -> list[dict]:
    """Anthropic turns as OpenAI chat messages (tool_use -> tool_calls, tool_result -> tool)."""
    if not isinstance(value, list) or not value:
        raise invalid("messages must be a non-empty list", "messages")
    out: list[dict] = []
    for i, m in enumerate(value):
        param = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise invalid(f"{param}.role must be user or assistant", f"{param}.role")
        blocks = m.get("content")
        if isinstance(blocks, str):
            out.append({"role": m["role"], "content": blocks})
            continue
        if not isinstance(blocks, list):
            raise invalid(f"{param}.content must be a string or a list of blocks",
                          f"{param}.content")
        texts, calls = [], []
        for j, b in enumerate(blocks):
            kind = b.get("type") if isinstance(b, dict) else None
            where = f"{param}.content[{j}]"
            if kind == "text" and isinstance(b.get("text"), str):
                texts.append({"type": "text", "text": b["text"]})
            elif kind == "tool_use" and m["role"] == "assistant" and isinstance(
                    b.get("name"), str) and isinstance(b.get("input", {}), dict):
                calls.append({"id": str(b.get("id", "")), "type": "function", "function": {
                    "name": b["name"], "arguments": json.dumps(b.get("input", {}))}})
            elif kind == "tool_result" and m["role"] == "user":
                out.append({"role": "tool", "tool_call_id": str(b.get("tool_use_id", "")),
                            "content": _text(f"{where}.content", b.get("content", ""))})
            else:
                raise invalid(f"{where} is not a text, tool_use (assistant) or tool_result "
                              "(user) block", where)
        if texts or calls or m["role"] == "assistant":
            msg = {"role": m["role"], "content": texts or ("" if calls else texts)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
    return out


def translate(body) -> dict:
    """An Anthropic Messages body as an OpenAI chat body (checked by `parse_request`)."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    for name in body:
        if name not in FIELDS:
            raise invalid(f"{name}: Extra inputs are not permitted", name)
    if body.get("max_tokens") is None:
        raise invalid("max_tokens: Field required", "max_tokens")
    chat = {k: body[k] for k in ("model", "max_tokens", "temperature", "top_p", "top_k",
                                 "stream") if body.get(k) is not None}
    if "temperature" in chat and not (isinstance(chat["temperature"], (int, float))
                                      and 0 <= chat["temperature"] <= 1):
        raise invalid("temperature must be in [0, 1]", "temperature")
    if body.get("stop_sequences") is not None:
        chat["stop"] = body["stop_sequences"]
    messages = _messages(body.get("messages"))
    if body.get("system") is not None:
        messages.insert(0, {"role": "system", "content": _text("system", body["system"])})
    chat["messages"] = messages
    if body.get("tools"):
        if not isinstance(body["tools"], list) or not all(isinstance(t, dict)
                                                          for t in body["tools"]):
            raise invalid("tools must be a list of tools", "tools")
        chat["tools"] = [{"type": "function", "function": {
            "name": t.get("name"), "description": t.get("description") or "",
            "parameters": t.get("input_schema", {"type": "object"})}} for t in body["tools"]]
    choice = body.get("tool_choice")
    if choice is not None:
        kind = choice.get("type") if isinstance(choice, dict) else None
        if kind not in ("auto", "any", "tool", "none"):
            raise invalid("tool_choice.type must be auto, any, tool or none", "tool_choice")
        chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(kind) or {
            "type": "function", "function": {"name": choice.get("name")}}
    return chat


def _blocks(text: str, tools: list) -> tuple[list[dict], str | None]:
    content, calls = tool_calls.parse(text, tools) if tools else (text, [])
    blocks = [{"type": "text", "text": content}] if content or not calls else []
    blocks += [{"type": "tool_use", "id": "toolu_" + c.id.removeprefix("call_"),
                "name": c.name, "input": json.loads(c.arguments)} for c in calls]
    return blocks, "tool_use" if calls else None


def _usage(stats) -> dict:
    return {"input_tokens": stats.prompt_tokens - stats.cached_tokens,
            "cache_read_input_tokens": stats.cached_tokens, "cache_creation_input_tokens": 0,
            "output_tokens": stats.generation_tokens}


def _event(kind: str, data: dict) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n".encode()


async def messages(request: Request) -> Response:
    """``POST /v1/messages``."""
    state = _state(request)
    try:
        principal = authenticate(request)
        parsed = parse_request("chat", translate(await read_json(request)))
        ids, params = await serving.prepare(state, parsed, principal)
        handle, reply = serving.submit(state, ids, params, parsed, principal)
    except APIError as e:
        return error_response(e)
    cut = {"kvchat": reply.extras()} if parsed.context else {}  # the context policy's cut
    tools = parsed.tools if parsed.uses_tools else []
    head = {"id": "msg_" + secrets.token_hex(12), "type": "message", "role": "assistant",
            "model": state.model_id}
    if parsed.stream:
        return EventStreamResponse(_stream(state, handle, head, tools, len(ids)),
                                   on_disconnect=serving.on_disconnect(state, handle),
                                   headers=reply.headers())
    try:
        text, final = await serving.whole_answer(state, request, handle)
    except APIError as e:
        return error_response(e)
    blocks, tool_stop = _blocks(text, tools)
    return JSONResponse({**head, "content": blocks, **_stop(final, tool_stop),
                         "usage": _usage(final.stats), **cut},
                        headers=reply.headers())


def _stop(final, tool_stop: str | None) -> dict:
    """``stop_reason`` and ``stop_sequence`` of an answer's final event."""
    matched = final.stats.stop_string if final.stats is not None else None
    if tool_stop:
        return {"stop_reason": tool_stop, "stop_sequence": None}
    if matched is not None:
        return {"stop_reason": "stop_sequence", "stop_sequence": matched}
    return {"stop_reason": STOP[final.finish_reason], "stop_sequence": None}


async def _stream(state, handle, head: dict, tools: list, prompt_tokens: int):
    """message_start, then per block start / deltas / stop, message_delta, message_stop."""
    yield _event("message_start", {"message": {
        **head, "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}}})
    held = tool_calls.ToolStream() if tools else None
    answer, opened = [], False
    async for event in state.pump.events(handle):
        answer.append(event.text)
        text = held.feed(event.text) if held is not None else event.text
        if text:
            if not opened:
                yield _event("content_block_start", {"index": 0, "content_block": {
                    "type": "text", "text": ""}})
                opened = True
            yield _event("content_block_delta", {"index": 0, "delta": {
                "type": "text_delta", "text": text}})
        if event.finish_reason is None:
            continue
        if event.finish_reason not in serving.ANSWERED:
            e = serving.unfinished(event.finish_reason, event.error)
            yield _event("error", {"error": {"type": ERROR_TYPES.get(e.status, "api_error"),
                                             "message": e.message}})
            return
        blocks, tool_stop = _blocks("".join(answer), tools)
        if held is not None and not tool_stop and held.held:  # held text was no call
            if not opened:
                yield _event("content_block_start", {"index": 0, "content_block": {
                    "type": "text", "text": ""}})
                opened = True
            yield _event("content_block_delta", {"index": 0, "delta": {
                "type": "text_delta", "text": held.held}})
        index = int(opened)
        if opened:
            yield _event("content_block_stop", {"index": 0})
        for b in (b for b in blocks if b["type"] == "tool_use"):
            yield _event("content_block_start", {"index": index, "content_block": {
                **b, "input": {}}})
            yield _event("content_block_delta", {"index": index, "delta": {
                "type": "input_json_delta", "partial_json": json.dumps(b["input"])}})
            yield _event("content_block_stop", {"index": index})
            index += 1
        yield _event("message_delta", {
            "delta": _stop(event, tool_stop),
            "usage": {"output_tokens": event.stats.generation_tokens}})
        yield _event("message_stop", {})
