"""Tool calls in a model's answer, by family: Hermes/Qwen ``<tool_call>`` JSON, Mistral
``[TOOL_CALLS][...]`` and Llama 3.x's bare ``{"name", "parameters"}`` object.

The server (`app.server.tool_calls`) parses calls of the tools a request offered; the chat,
which offers none, shows whatever calls the model wrote (``names`` None), folded.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Collection
from dataclasses import dataclass

NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
MARKERS = ("<tool_call>", "[TOOL_CALLS]")


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = ""

    def __post_init__(self):
        self.id = self.id or "call_" + secrets.token_hex(12)

    def to_dict(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function",
               "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def _call(obj) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args))


def _json(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def _bare_call(text: str, names: Collection[str] | None) -> ToolCall | None:
    """Llama 3.x's call: the whole answer one JSON object naming a function. Without
    ``names`` only its exact shape counts, so a JSON answer is not taken for a call."""
    obj = _json(text.strip())
    if names is None and not (isinstance(obj, dict) and set(obj) == {"name", "parameters"}
                              and isinstance(obj["name"], str) and NAME.fullmatch(obj["name"])
                              and isinstance(obj["parameters"], dict)):
        return None
    call = _call(obj)
    return call if call is not None and (names is None or call.name in names) else None


_CLOSE = re.compile(r"\s*(?:</tool_call>\s*(?:<tool_call>)?)?\s*")
_DECODER = json.JSONDecoder()


def _hermes_calls(rest: str) -> list[ToolCall | None]:
    """The calls after a first ``<tool_call>``, each read as one JSON value, so a
    ``</tool_call>`` inside an argument string does not cut it; anything else: [None]."""
    calls: list[ToolCall | None] = []
    pos = _CLOSE.match(rest).end()
    while pos < len(rest):
        try:
            obj, pos = _DECODER.raw_decode(rest, pos)
        except ValueError:
            return [None]
        calls.append(_call(obj))
        pos = _CLOSE.match(rest, pos).end()
    return calls


def parse_calls(text: str, names: Collection[str] | None = None, *,
                bare_json: bool = True) -> tuple[str, list[ToolCall]]:
    """(content, calls) of an answer. ``names``: the functions offered (a call of another
    leaves the answer as text); None: any function. ``bare_json``: Llama's bare object counts."""
    calls: list[ToolCall | None] = []
    if "<tool_call>" in text:
        content, _, rest = text.partition("<tool_call>")
        calls = _hermes_calls(rest)
    elif "[TOOL_CALLS]" in text:
        content, _, rest = text.partition("[TOOL_CALLS]")
        found = _json(rest.strip())
        calls = [_call(c) for c in (found if isinstance(found, list) else [found])]
    else:
        if bare_json and text.lstrip().startswith("{"):
            call = _bare_call(text, names)
            if call is not None:
                return "", [call]
        return text, []
    if calls and all(c is not None and (names is None or c.name in names) for c in calls):
        return content.strip(), calls  # type: ignore[return-value]
    return text, []


class ToolStream:
    """Streams an answer's text while it cannot yet be a tool call; holds it from the
    first thing that may start one (a marker, or a ``{``/``[`` opening the answer), so calls
    go out as calls, never as text."""

    def __init__(self):
        self.held = ""
        self.started = False  # some text went out: a bare JSON call can no longer start

    def feed(self, text: str) -> str:
        """Text safe to send now."""
        self.held += text
        if any(m in self.held for m in MARKERS) or (
                not self.started and self.held.lstrip().startswith(("{", "["))):
            return ""
        cut = len(self.held)
        for m in MARKERS:  # keep a tail that may be the start of a marker
            for k in range(len(m) - 1, 0, -1):
                if self.held.endswith(m[:k]):
                    cut = min(cut, len(self.held) - k)
                    break
        if not self.started and not self.held[:cut].strip():
            return ""  # leading whitespace: a JSON call may still follow
        out, self.held = self.held[:cut], self.held[cut:]
        self.started = self.started or bool(out)
        return out
