"""Request bodies of the OpenAI API, checked field by field into one `ParsedRequest`.

Only what kvchat implements is accepted: messages / prompt, max_tokens (and
max_completion_tokens), temperature, top_p, stop, seed, stream and stream_options,
response_format (text, json_object, json_schema: constrained decoding), n, logprobs
(`request_fields`), plus fields that
change nothing (``model``, ``user``, ``metadata``...) and local extensions that mlx-lm's
and llama.cpp's servers also take (top_k, min_p, repetition_penalty; llama.cpp's
``json_schema`` and ``grammar``, and ``regex``). A real OpenAI field with a value we do not
implement (best_of, echo, store...) is a 400 that names it; a field
OpenAI does not have is a 400 too ("Unrecognized request argument supplied"), so a typo
is never silently ignored. Nothing here touches the engine or the web framework.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from app.server import output_schema, request_fields, tool_calls
from app.server.errors import APIError, invalid, unsupported
from app.server.values import boolean as _bool
from app.server.values import integer as _int
from app.server.values import number as _number
from app.server.values import only as _only
from app.server.values import string as _string
from app.server.values import unicode_text as _unicode
from engine.constraint import Constraint

MAX_MESSAGES = 4096
MAX_STOP = 16  # the engine's bound (OpenAI's is 4)
MAX_STOP_CHARS = 256
SEED_LIMIT = 1 << 64
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
         "tool": "tool"}


@dataclass(slots=True)
class ParsedRequest:
    """A checked /v1/chat/completions or /v1/completions body."""

    kind: str  # "chat" or "text"
    messages: list[dict] = field(default_factory=list)  # chat: [{"role", "content"}]
    prompt: str | list[int] | None = None  # text: a string, or token ids
    model: str | None = None
    max_tokens: int | None = None  # None: the server's default
    temperature: float = 1.0  # OpenAI's defaults
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    constraint: Constraint | None = None  # response_format / json_schema / grammar / regex
    tools: list[tool_calls.Tool] = field(default_factory=list)
    tool_choice: str = "auto"  # "auto", "none", "required" or a function's name
    parallel_tool_calls: bool = True
    template_kwargs: dict = field(default_factory=dict)  # enable_thinking, reasoning_effort
    n: int = 1  # answers to sample (`app.server.choices`)
    logprobs: int | None = None  # alternatives per token to report; None: no logprobs
    thinking_budget: int | None = None  # given, or from reasoning_effort
    context: dict | None = None  # what the context policy cut or summarized (server.context)

    @property
    def uses_tools(self) -> bool:
        """Tools are rendered into the prompt and calls parsed out of the answer."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def text_chars(self) -> int:
        """Characters of prompt text (to refuse a huge prompt before tokenizing it)."""
        if self.kind == "chat":
            return sum(len(m["content"]) for m in self.messages)
        return len(self.prompt) if isinstance(self.prompt, str) else 0

    @property
    def prompt_param(self) -> str:
        return "messages" if self.kind == "chat" else "prompt"


# -- value checks: each returns the value to store, or raises a 400 naming the field -----

def _stop(name: str, value) -> list[str]:
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or len(stops) > MAX_STOP \
            or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops):
        raise invalid(f"stop must be a string or a list of at most {MAX_STOP} non-empty "
                      f"strings of at most {MAX_STOP_CHARS} characters", name)
    return [_unicode(name, s) for s in stops]


def _stream_options(name: str, value) -> bool:
    if not isinstance(value, dict) or set(value) - {"include_usage"}:
        raise invalid('stream_options must be {"include_usage": true|false}', name)
    return _bool("stream_options.include_usage", value.get("include_usage", False))


def _text_parts(role: str, content, i: int) -> str:
    param = f"messages[{i}].content"
    if isinstance(content, str):
        return _unicode(param, content)
    if content is None and role == "assistant":
        return ""
    if not isinstance(content, list):
        raise invalid(f"{param} must be a string or a list of text parts", param)
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise unsupported(param, f"a content part of type {kind!r} (only 'text')")
        texts.append(_string(param, part.get("text")))
    return "".join(texts)


def _messages(name: str, value) -> list[dict]:
    if not isinstance(value, list) or not 0 < len(value) <= MAX_MESSAGES:
        raise invalid(f"messages must be a list of 1..{MAX_MESSAGES} messages", name)
    out = []
    for i, m in enumerate(value):
        param = f"messages[{i}]"
        if not isinstance(m, dict):
            raise invalid(f"{param} must be an object with a role and content", param)
        role = m.get("role")
        if not isinstance(role, str):  # a list or an object is unhashable: no lookup
            raise invalid(f"{param}.role must be one of {sorted(ROLES)}", f"{param}.role")
        if role == "function":
            raise unsupported(f"{param}.role", "the deprecated 'function' role (use 'tool')")
        if role not in ROLES:
            raise invalid(f"{param}.role must be one of {sorted(ROLES)}, got {role!r:.40}",
                          f"{param}.role")
        msg = {"role": ROLES[role], "content": _text_parts(role, m.get("content"), i)}
        for key in set(m) - {"role", "content", "name"}:
            if key in ("refusal", "tool_calls", "function_call") and m[key] in (None, []):
                continue
            if key == "tool_calls" and role == "assistant":
                msg["tool_calls"] = tool_calls.check_history_calls(f"{param}.tool_calls", m[key])
            elif key == "tool_call_id" and role == "tool":
                msg["tool_call_id"] = _string(f"{param}.tool_call_id", m[key])
            else:
                raise unsupported(f"{param}.{key}", f"{key!r} in a message")
        out.append(msg)
    if out[-1]["role"] not in ("user", "tool"):
        raise invalid("the last message must be from the user or a tool",
                      f"messages[{len(out) - 1}]")
    if not out[-1]["content"].strip():
        raise invalid("the last message is empty", f"messages[{len(out) - 1}].content")
    return out


def _prompt(name: str, value) -> str | list[int]:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]  # a batch of one
    if isinstance(value, str):
        if not value.strip():
            raise invalid("prompt is empty", name)
        return _unicode(name, value)
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool)
                                                 for t in value):
        return value  # token ids; the engine checks their range
    if isinstance(value, list) and len(value) > 1:
        raise unsupported(name, "a batch of several prompts (send one request per prompt)")
    raise invalid("prompt must be a non-empty string or a list of token ids", name)


# name -> (check, attribute of ParsedRequest it sets, or None when the value changes nothing)
_Check = Callable[[str, object], object]
COMMON: dict[str, tuple[_Check, str | None]] = {
    "model": (_string, "model"),
    "max_tokens": (lambda n, v: _int(n, v, 1, 1 << 31), "max_tokens"),
    "temperature": (lambda n, v: _number(n, v, 0.0, 2.0), "temperature"),
    "top_p": (lambda n, v: _number(n, v, 0.0, 1.0), "top_p"),
    "stop": (_stop, "stop"),
    "seed": (lambda n, v: _int(n, v, 0, SEED_LIMIT), "seed"),
    "stream": (_bool, "stream"),
    "stream_options": (_stream_options, "include_usage"),
    "user": (_string, None),
    "n": (request_fields.n, "n"),
    "thinking_budget": (request_fields.thinking_budget, "thinking_budget"),
    "presence_penalty": (lambda n, v: _number(n, v, -2.0, 2.0), "presence_penalty"),
    "frequency_penalty": (lambda n, v: _number(n, v, -2.0, 2.0), "frequency_penalty"),
    "logit_bias": (request_fields.logit_bias, "logit_bias"),
    "top_k": (lambda n, v: _int(n, v, 0, 1 << 31), "top_k"),
    "min_p": (lambda n, v: _number(n, v, 0.0, 1.0), "min_p"),
    "repetition_penalty": (lambda n, v: _number(n, v, 1e-3, 100.0), "repetition_penalty"),
    "json_schema": (output_schema.local_constraint("json_schema"), "constraint"),
    "grammar": (output_schema.local_constraint("grammar"), "constraint"),
    "regex": (output_schema.local_constraint("regex"), "constraint"),
}
CHAT = {
    **COMMON,
    "messages": (_messages, "messages"),
    "max_completion_tokens": (lambda n, v: _int(n, v, 1, 1 << 31), "max_tokens"),
    "logprobs": (_bool, None),  # with top_logprobs: `request_fields.settle`
    "top_logprobs": (request_fields.top_logprobs, None),
    "response_format": (output_schema.response_format, "constraint"),
    "tools": (tool_calls.check_tools, "tools"),
    "tool_choice": (tool_calls.check_tool_choice, "tool_choice"),
    "parallel_tool_calls": (_bool, "parallel_tool_calls"),
    "reasoning_effort": (request_fields.reasoning_effort, None),
    "chat_template_kwargs": (request_fields.template_kwargs, None),
    "store": (_only((False,), "store"), None),
    "metadata": (lambda n, v: None, None),
    "service_tier": (_only(("auto", "default"), "a service_tier"), None),
    "modalities": (_only((["text"],), "modalities other than text"), None),
}
TEXT = {
    **COMMON,
    "prompt": (_prompt, "prompt"),
    "echo": (_only((False,), "echo"), None),
    "suffix": (_only(("",), "suffix"), None),
    "best_of": (_only((1,), "best_of other than 1"), None),
    "logprobs": (request_fields.legacy_logprobs, "logprobs"),
}


def parse_request(kind: str, body) -> ParsedRequest:
    """Check a request body (``kind`` "chat" or "text"); raises `APIError` (400)."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    fields, required = (CHAT, "messages") if kind == "chat" else (TEXT, "prompt")
    for name in body:
        if name not in fields:
            raise invalid(f"Unrecognized request argument supplied: {name:.60}", name,
                          "unknown_parameter")
    if body.get(required) is None:
        raise invalid(f"you must provide '{required}'", required, "missing_required_parameter")
    if body.get("max_tokens") is not None and body.get("max_completion_tokens") is not None \
            and body["max_tokens"] != body["max_completion_tokens"]:
        raise invalid("give max_tokens or max_completion_tokens, not both",
                      "max_completion_tokens")
    given = [n for n in output_schema.CONSTRAINTS if body.get(n) is not None
             and not (n == "response_format" and body[n] == {"type": "text"})]
    if len(given) > 1:
        raise invalid(f"give one of {', '.join(given)}, not several", given[1])
    parsed = ParsedRequest(kind)
    for name, value in body.items():
        if value is None:  # null means "the default", as in OpenAI's API
            continue
        check, attr = fields[name]
        result = check(name, value)
        if attr is not None:
            setattr(parsed, attr, result)
    if "stream_options" in body and body["stream_options"] is not None and not parsed.stream:
        raise invalid("stream_options is only allowed when stream is true", "stream_options")
    if kind == "chat":
        _check_tool_use(parsed)
        parsed.template_kwargs = {**(body.get("chat_template_kwargs") or {})}
        if body.get("reasoning_effort") is not None:
            parsed.template_kwargs["reasoning_effort"] = body["reasoning_effort"]
    request_fields.settle(parsed, body)
    return parsed


def _check_tool_use(p: ParsedRequest) -> None:
    names = {t.name for t in p.tools}
    if p.tool_choice not in ("auto", "none") and not p.tools:
        raise invalid("tool_choice needs tools", "tool_choice")
    if p.tool_choice not in ("auto", "none", "required") and p.tool_choice not in names:
        raise invalid(f"tool_choice names {p.tool_choice!r:.70}, which is not in tools",
                      "tool_choice")
    if p.uses_tools and p.constraint is not None and p.tool_choice != "auto":
        raise invalid("a required tool call and a response_format cannot both hold",
                      "response_format")


__all__ = ["APIError", "ParsedRequest", "parse_request"]
