"""OpenAI's Responses API, ``POST /v1/responses``, over the same engine, tenants and limits.

Stateless (``store`` is refused, as kvchat keeps no conversations server-side): ``input``
as a string or a list of message, ``function_call`` and ``function_call_output`` items,
``instructions`` (the system message), ``max_output_tokens``, ``temperature``, ``top_p``,
``stream``, function ``tools`` and ``tool_choice``. The body is translated into the chat
request kvchat already serves, so the same greedy request gives the same text here as on
/v1/chat/completions. Answers are ``message`` items with ``output_text`` and
``function_call`` items; streams send the documented ``response.*`` events.
"""

from __future__ import annotations

import json
import secrets
import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from app.server import serving, tool_calls
from app.server.errors import APIError, invalid, unsupported
from app.server.openai_schema import parse_request
from app.server.request_in import _state, authenticate, read_json
from app.server.streaming import EventStreamResponse

FIELDS = {"model", "input", "instructions", "max_output_tokens", "temperature", "top_p",
          "stream", "tools", "tool_choice", "parallel_tool_calls", "store", "metadata", "user"}
ROLES = ("user", "system", "developer", "assistant")


def _content(param: str, value) -> str:
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise invalid(f"{param} must be a string or a list of parts", param)
    parts = []
    for i, p in enumerate(value):
        if not isinstance(p, dict) or p.get("type") not in ("input_text", "output_text") \
                or not isinstance(p.get("text"), str):
            raise unsupported(f"{param}[{i}]", "a content part other than input_text")
        parts.append(p["text"])
    return "".join(parts)


def _input(value) -> list[dict]:
    """Input items as chat messages (function calls and their outputs included)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise invalid("input must be a string or a non-empty list of items", "input")
    out: list[dict] = []
    for i, item in enumerate(value):
        param = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message" and item.get("role") in ROLES:
            out.append({"role": item["role"],
                        "content": _content(f"{param}.content", item.get("content"))})
        elif kind == "function_call":
            call = {"id": str(item.get("call_id", "")), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            if out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": str(item.get("call_id", "")),
                        "content": _content(f"{param}.output", item.get("output"))})
        else:
            raise invalid(f"{param} must be a message, function_call or function_call_output",
                          param)
    return out


def translate(body) -> dict:
    """A Responses body as an OpenAI chat body (checked by `parse_request`)."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    for name in body:
        if name not in FIELDS:
            raise invalid(f"Unrecognized request argument supplied: {name:.60}", name,
                          "unknown_parameter")
    if body.get("store"):
        raise unsupported("store", "store (kvchat keeps no responses; send the history)")
    if body.get("input") is None:
        raise invalid("you must provide 'input'", "input", "missing_required_parameter")
    chat = {k: body[k] for k in ("model", "temperature", "top_p", "stream", "user",
                                 "parallel_tool_calls") if body.get(k) is not None}
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    messages = _input(body["input"])
    if body.get("instructions") is not None:
        messages.insert(0, {"role": "system",
                            "content": _content("instructions", body["instructions"])})
    chat["messages"] = messages
    if body.get("tools"):
        if not isinstance(body["tools"], list) or not all(
                isinstance(t, dict) and t.get("type") == "function" for t in body["tools"]):
            raise unsupported("tools", "tools other than functions")
        chat["tools"] = [{"type": "function", "function": {
            k: t[k] for k in ("name", "description", "parameters", "strict") if k in t}}
            for t in body["tools"]]
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function":
        chat["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
    elif choice is not None:
        chat["tool_choice"] = choice
    return chat


def _output(text: str, tools: list) -> list[dict]:
    content, calls = tool_calls.parse(text, tools) if tools else (text, [])
    out = []
    if content or not calls:
        out.append({"type": "message", "id": "msg_" + secrets.token_hex(12),
                    "status": "completed", "role": "assistant",
                    "content": [{"type": "output_text", "text": content, "annotations": []}]})
    out += [{"type": "function_call", "id": "fc_" + secrets.token_hex(12), "call_id": c.id,
             "name": c.name, "arguments": c.arguments, "status": "completed"} for c in calls]
    return out


def _usage(stats) -> dict:
    return {"input_tokens": stats.prompt_tokens,
            "input_tokens_details": {"cached_tokens": stats.cached_tokens},
            "output_tokens": stats.generation_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": stats.prompt_tokens + stats.generation_tokens}


def _body(head: dict, status: str, output: list, usage: dict | None,
          incomplete: str | None = None) -> dict:
    return {**head, "status": status, "output": output, "usage": usage,
            "incomplete_details": {"reason": incomplete} if incomplete else None}


async def responses(request: Request) -> Response:
    """``POST /v1/responses``."""
    state = _state(request)
    principal = authenticate(request)
    parsed = parse_request("chat", translate(await read_json(request)))
    ids, params = await serving.prepare(state, parsed, principal)
    handle, reply = serving.submit(state, ids, params, parsed, principal)
    tools = parsed.tools if parsed.uses_tools else []
    extra = {"kvchat": reply.extras()} if parsed.context else {}  # the context policy's cut
    head = {"id": "resp_" + secrets.token_hex(12), "object": "response",
            "created_at": int(time.time()), "model": state.model_id, "error": None}
    if parsed.stream:
        return EventStreamResponse(_stream(state, handle, head, tools),
                                   on_disconnect=serving.on_disconnect(state, handle),
                                   headers=reply.headers())
    text, final = await serving.whole_answer(state, request, handle)
    cut = "max_output_tokens" if final.finish_reason == "length" else None
    return JSONResponse({**_body(head, "incomplete" if cut else "completed",
                                 _output(text, tools), _usage(final.stats), cut), **extra},
                        headers=reply.headers())


async def _stream(state, handle, head: dict, tools: list):
    seq = iter(range(1 << 62))

    def event(kind: str, **data) -> bytes:
        payload = {"type": kind, "sequence_number": next(seq), **data}
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n".encode()

    yield event("response.created", response=_body(head, "in_progress", [], None))
    yield event("response.in_progress", response=_body(head, "in_progress", [], None))
    held = tool_calls.ToolStream() if tools else None
    item = {"type": "message", "id": "msg_" + secrets.token_hex(12), "status": "in_progress",
            "role": "assistant", "content": []}
    answer, sent, opened = [], [], False
    async for ev in state.pump.events(handle):
        answer.append(ev.text)
        text = held.feed(ev.text) if held is not None else ev.text
        output = None
        if ev.finish_reason in serving.ANSWERED:
            output = _output("".join(answer), tools)
            if held is not None and output[-1]["type"] == "message":  # held text: no call
                text += held.held
        if text:
            if not opened:
                yield event("response.output_item.added", output_index=0, item=item)
                yield event("response.content_part.added", item_id=item["id"], output_index=0,
                            content_index=0, part={"type": "output_text", "text": "",
                                                   "annotations": []})
                opened = True
            sent.append(text)
            yield event("response.output_text.delta", item_id=item["id"], output_index=0,
                        content_index=0, delta=text)
        if ev.finish_reason is None:
            continue
        if ev.finish_reason not in serving.ANSWERED:
            e: APIError = serving.unfinished(ev.finish_reason, ev.error)
            yield event("error", code=e.code, message=e.message, param=None)
            return
        if output[0]["type"] == "message" and opened:
            output[0]["id"] = item["id"]
            text = "".join(sent)
            output[0]["content"][0]["text"] = text
            part = output[0]["content"][0]
            yield event("response.output_text.done", item_id=item["id"], output_index=0,
                        content_index=0, text=text)
            yield event("response.content_part.done", item_id=item["id"], output_index=0,
                        content_index=0, part=part)
            yield event("response.output_item.done", output_index=0, item=output[0])
        for index, out in enumerate(output):
            if out["type"] == "function_call" or not opened:
                yield event("response.output_item.added", output_index=index, item=out)
                yield event("response.output_item.done", output_index=index, item=out)
        cut = "max_output_tokens" if ev.finish_reason == "length" else None
        yield event("response.incomplete" if cut else "response.completed",
                    response=_body(head, "incomplete" if cut else "completed", output,
                                   _usage(ev.stats), cut))
