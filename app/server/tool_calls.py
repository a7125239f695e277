"""Tool calling on /v1/chat/completions: tools into the prompt, calls out of the answer.

Rendering: a chat template that takes ``tools`` (its source names them) gets them through
``apply_chat_template(tools=...)``, with the conversation's calls and results as
structured messages. One that does not (the default SmolLM2's plain ChatML) gets kvchat's
documented default, the Hermes format Qwen 2.5's own template writes: the tools' JSON in
the system message, each call as ``<tool_call>{"name", "arguments"}</tool_call>`` and each
result as a user turn in ``<tool_response>`` tags.

Parsing, by model family: Hermes/Qwen ``<tool_call>`` JSON, Mistral ``[TOOL_CALLS][...]``,
and Llama 3.x's bare ``{"name", "parameters"}`` object. ``tool_choice`` ``required`` or a
named function decodes under a grammar (`engine.constraint`), so the call is valid JSON for
the function's schema.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from app.server.errors import invalid
from app.tool_calls import MARKERS, NAME, ToolCall, ToolStream, parse_calls
from engine.constraint import JSON_OPTIONS, Constraint

__all__ = ["MARKERS", "Tool", "ToolCall", "ToolStream", "check_tool_choice", "check_tools",
           "grammar", "parse", "render", "style_of"]

MAX_TOOLS = 128
HERMES_SYSTEM = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "{tools}\n</tools>\n\nFor each function call, return a json object with function name "
    "and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    description: str
    parameters: dict

    def spec(self) -> dict:
        return {"type": "function", "function": {"name": self.name,
                                                 "description": self.description,
                                                 "parameters": self.parameters}}


# -- request checks --------------------------------------------------------------------

def check_tools(name: str, value) -> list[Tool]:
    """OpenAI's ``tools``: ``[{"type": "function", "function": {"name", ...}}]``."""
    if not isinstance(value, list) or len(value) > MAX_TOOLS:
        raise invalid(f"tools must be a list of at most {MAX_TOOLS} tools", name)
    tools: list[Tool] = []
    for i, t in enumerate(value):
        param = f"{name}[{i}]"
        f = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(f, dict) or set(t) - {"type", "function"}:
            raise invalid(f'{param} must be {{"type": "function", "function": {{...}}}}', param)
        fname, params = f.get("name"), f.get("parameters", {"type": "object"})
        if not isinstance(fname, str) or not NAME.fullmatch(fname):
            raise invalid(f"{param}.function.name must be 1-64 letters, digits, _ . or -",
                          f"{param}.function.name")
        if any(tool.name == fname for tool in tools):
            raise invalid(f"two tools are named {fname!r}", f"{param}.function.name")
        if not isinstance(params, dict):
            raise invalid(f"{param}.function.parameters must be a JSON schema object",
                          f"{param}.function.parameters")
        description = f.get("description") or ""
        if not isinstance(description, str) or set(f) - {"name", "description", "parameters",
                                                         "strict"}:
            raise invalid(f"{param}.function has a bad or unknown field", f"{param}.function")
        tools.append(Tool(fname, description, params))
    return tools


def check_tool_choice(name: str, value) -> str:
    """"auto", "none", "required", or the name of one function."""
    if value in ("auto", "none", "required"):
        return value
    f = value.get("function") if isinstance(value, dict) and value.get("type") == "function" \
        else None
    if isinstance(f, dict) and isinstance(f.get("name"), str):
        return f["name"]
    raise invalid('tool_choice must be "auto", "none", "required" or {"type": "function", '
                  '"function": {"name": ...}}', name)


def check_history_calls(param: str, value) -> list[dict]:
    """An assistant message's earlier ``tool_calls``: ``[{"id", "type", "function"}]``."""
    if not isinstance(value, list):
        raise invalid(f"{param} must be a list", param)
    out = []
    for i, c in enumerate(value):
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) \
                or not isinstance(f.get("arguments", ""), str):
            raise invalid(f"{param}[{i}] must be a function call with a name and arguments",
                          f"{param}[{i}]")
        arguments = f.get("arguments") or "{}"
        try:
            parsed = json.loads(arguments)
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict):  # the template would render it as something else
            raise invalid(f"{param}[{i}].function.arguments must be a JSON object in a "
                          f"string, not {arguments[:40]!r}", f"{param}[{i}]")
        out.append({"id": str(c.get("id", "")), "type": "function",
                    "function": {"name": f["name"], "arguments": arguments}})
    return out


# -- prompt ----------------------------------------------------------------------------

def _arguments(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


def render(messages: list[dict], tools: list[Tool], native: bool) -> tuple[list[dict], list]:
    """(messages, tools) for ``apply_chat_template``: structured for a ``native`` template,
    else kvchat's Hermes default written into plain messages."""
    if native:
        out = []
        for m in messages:
            m = dict(m)
            if "tool_calls" in m:
                m["tool_calls"] = [{**c, "function": {**c["function"], "arguments":
                                                      _arguments(c["function"]["arguments"])}}
                                   for c in m["tool_calls"]]
            out.append(m)
        return out, [t.spec() for t in tools]
    out = []
    for m in messages:
        if m["role"] == "tool":
            out.append({"role": "user",
                        "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        elif m.get("tool_calls"):
            calls = "\n".join(
                "<tool_call>\n" + json.dumps({"name": c["function"]["name"], "arguments":
                                              _arguments(c["function"]["arguments"])})
                + "\n</tool_call>" for c in m["tool_calls"])
            out.append({"role": "assistant", "content": (m["content"] + "\n" if m["content"]
                                                         else "") + calls})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    if tools:
        listing = "\n".join(json.dumps(t.spec()) for t in tools)
        text = HERMES_SYSTEM.format(tools=listing)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out, []


def closed(schema, depth: int = 0):
    """``schema`` with every object that declares ``properties`` but says nothing of others
    closed to them (``additionalProperties: false``), for a forced call's grammar only: JSON
    Schema allows undeclared keys by default, and a small model sampled under it fills a
    call with invented ones until max_tokens cuts it. Past 32 levels a schema is kept as is."""
    if depth > 32:
        return schema
    if isinstance(schema, list):
        return [closed(s, depth + 1) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v, depth + 1) if k in _SUBSCHEMAS else v for k, v in schema.items()}
    for k in _NAMED_SUBSCHEMAS:
        if isinstance(out.get(k), dict):
            out[k] = {name: closed(v, depth + 1) for name, v in out[k].items()}
    if isinstance(out.get("properties"), dict) and "additionalProperties" not in out \
            and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out


_SUBSCHEMAS = ("items", "anyOf", "oneOf", "allOf", "prefixItems")
_NAMED_SUBSCHEMAS = ("properties", "$defs", "definitions")


def grammar(tools: list[Tool], choice: str, parallel: bool, style: str) -> Constraint:
    """The grammar a ``required`` or named ``tool_choice`` decodes under."""
    chosen = [t for t in tools if choice == "required" or t.name == choice]
    key = "parameters" if style == "llama" else "arguments"
    calls = [{"type": "object",
              "properties": {"name": {"const": t.name}, key: closed(t.parameters)},
              "required": ["name", key], "additionalProperties": False} for t in chosen]
    # compact JSON, as for response_format: free whitespace lets a small model pad a call
    # with newlines until max_tokens cuts it
    schema = json.dumps({**(calls[0] if len(calls) == 1 else {"anyOf": calls}),
                         "x-guidance": JSON_OPTIONS})
    if style == "mistral":
        items = json.dumps({"type": "array", "items": json.loads(schema), "minItems": 1,
                            "x-guidance": JSON_OPTIONS, **({} if parallel else {"maxItems": 1})})
        return Constraint("grammar", f'start: "[TOOL_CALLS]" %json {items}\n')
    if style == "llama":
        return Constraint("grammar", f"start: %json {schema}\n")
    # at most one call per function offered: a small model would repeat one call forever
    more = f' ("\\n" call) ~ 0..{len(chosen) - 1}' if parallel and len(chosen) > 1 else ""
    return Constraint("grammar", f'start: call{more}\n'
                                 f'call: "<tool_call>\\n" %json {schema} "\\n</tool_call>"\n')


def style_of(template: str | None) -> str:
    """Which family's call format a chat template writes: hermes, mistral or llama."""
    template = template or ""
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "tools" in template and "<tool_call>" not in template:
        return "llama"
    return "hermes"


# -- answer ----------------------------------------------------------------------------

def parse(text: str, tools: list[Tool]) -> tuple[str, list[ToolCall]]:
    """(content, calls) of an answer; calls of unknown functions are left as text."""
    return parse_calls(text, {t.name for t in tools})
