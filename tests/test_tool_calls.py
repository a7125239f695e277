"""Tool calling's pieces (`app.server.tool_calls`): request checks, the Hermes default
prompt, the grammars of required and named calls, parsing by family, and streaming that
never lets a call out as text."""

from __future__ import annotations

import json

import pytest

from app.server import tool_calls as tc
from app.server.errors import APIError
from app.server.openai_schema import parse_request

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
USER = [{"role": "user", "content": "Weather in Paris?"}]


def refused(body) -> APIError:
    with pytest.raises(APIError) as info:
        parse_request("chat", body)
    return info.value


def test_tools_and_choices_are_checked():
    p = parse_request("chat", {"messages": USER, "tools": [WEATHER, TIME],
                               "tool_choice": {"type": "function",
                                               "function": {"name": "get_time"}}})
    assert [t.name for t in p.tools] == ["get_weather", "get_time"] and p.uses_tools
    assert p.tool_choice == "get_time"
    assert not parse_request("chat", {"messages": USER, "tools": [WEATHER],
                                      "tool_choice": "none"}).uses_tools
    assert refused({"messages": USER, "tools": [WEATHER], "tool_choice": {
        "type": "function", "function": {"name": "nope"}}}).param == "tool_choice"
    assert refused({"messages": USER, "tool_choice": "required"}).param == "tool_choice"
    assert refused({"messages": USER, "tools": [WEATHER, WEATHER]}).param.endswith("name")
    assert refused({"messages": USER, "tools": [{"type": "function", "function": {
        "name": "bad name!"}}]}).param == "tools[0].function.name"
    assert refused({"messages": USER, "tools": [{"type": "retrieval"}]}).param == "tools[0]"
    assert refused({"messages": USER, "tools": "x"}).param == "tools"
    assert refused({"messages": USER, "tools": [WEATHER], "tool_choice": "required",
                    "response_format": {"type": "json_object"}}).param == "response_format"


def test_tool_turns_in_the_history():
    history = USER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 18}'}]
    p = parse_request("chat", {"messages": history, "tools": [WEATHER]})
    assert p.messages[1]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert p.messages[2] == {"role": "tool", "content": '{"temp_c": 18}',
                             "tool_call_id": "call_1"}
    assert refused({"messages": USER + [{"role": "assistant", "content": "x",
                                         "tool_calls": [{"function": 3}]}, *USER]}
                   ).param == "messages[1].tool_calls[0]"
    for bad in ('{"city": "Par', '["Paris"]', "Paris"):  # arguments that cannot parse to an object
        call = {"id": "c", "type": "function",
                "function": {"name": "get_weather", "arguments": bad}}
        e = refused({"messages": USER + [{"role": "assistant", "content": None,
                                          "tool_calls": [call]}, *USER], "tools": [WEATHER]})
        assert e.param == "messages[1].tool_calls[0]" and "JSON object" in e.message
    msgs, tools = tc.render(p.messages, p.tools, native=False)
    assert tools == [] and msgs[0]["role"] == "system" and "<tools>" in msgs[0]["content"]
    assert '"name": "get_weather"' in msgs[0]["content"]
    assert msgs[2]["content"] == ('<tool_call>\n{"name": "get_weather", "arguments": '
                                  '{"city": "Paris"}}\n</tool_call>')
    assert msgs[3] == {"role": "user",
                       "content": '<tool_response>\n{"temp_c": 18}\n</tool_response>'}
    native, specs = tc.render(p.messages, p.tools, native=True)
    assert specs[0]["function"]["name"] == "get_weather"
    assert native[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}


@pytest.mark.parametrize("text,content,calls", [
    ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
     '</tool_call>', "Let me check.", [("get_weather", {"city": "Oslo"})]),
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "A"}}</tool_call>\n'
     '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>', "",
     [("get_weather", {"city": "A"}), ("get_time", {"zone": "UTC"})]),
    ('[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "CET"}}]', "",
     [("get_time", {"zone": "CET"})]),
    ('{"name": "get_weather", "parameters": {"city": "Rome"}}', "",
     [("get_weather", {"city": "Rome"})]),
    ("Plain answer.", "Plain answer.", []),
    ('<tool_call>{"name": "launch_missiles", "arguments": {}}</tool_call>', None, []),
    ('<tool_call>{"name": "get_weather", "arguments": {"ci', None, []),  # cut: left as text
    ('{"name": "someone", "age": 3}', None, []),  # JSON that is not a call to a tool
    # a sampled forced call wrote the closing tag inside an argument string (was left as text)
    ('<tool_call>\n{"name": "get_time", "arguments": {"zone": "]]}</tool_call>M"}}\n</tool_call>',
     "", [("get_time", {"zone": "]]}</tool_call>M"})]),
    ('<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call> Done.', None,
     []),  # text after the last call: not a clean call, left as text
])
def test_calls_are_parsed_by_family(text, content, calls):
    tools = tc.check_tools("tools", [WEATHER, TIME])
    got_content, got = tc.parse(text, tools)
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    assert got_content == (text if content is None else content)
    assert all(c.id.startswith("call_") and c.to_dict()["type"] == "function" for c in got)


@pytest.mark.parametrize("style", ["hermes", "mistral", "llama"])
@pytest.mark.parametrize("choice", ["required", "get_time"])
def test_required_and_named_grammars_compile_and_hold(default_engine, style, choice):
    tools = tc.check_tools("tools", [WEATHER, TIME])
    c = tc.grammar(tools, choice, parallel=True, style=style)
    default_engine.grammars.check(c)  # compiles under the real tokenizer
    key = "parameters" if style == "llama" else "arguments"
    call = json.dumps({"name": "get_time", key: {"zone": "UTC"}}, separators=(",", ":"))
    good = {"hermes": f"<tool_call>\n{call}\n</tool_call>", "mistral": f"[TOOL_CALLS][{call}]",
            "llama": call}[style]
    bad = good.replace("UTC", "PST")  # outside the function's enum
    m = default_engine.grammars.matcher(c)
    good_ids, bad_ids = (default_engine.tokenizer.encode(t, add_special_tokens=False)
                         for t in (good, bad))
    assert m.accepts(good_ids) == len(good_ids)
    assert m.accepts(bad_ids) < len(bad_ids)


def test_styles_follow_the_template():
    assert tc.style_of(None) == "hermes"
    assert tc.style_of("{% for m in messages %}...<tool_call>{{ tools }}") == "hermes"
    assert tc.style_of("[AVAILABLE_TOOLS]{{ tools }}[TOOL_CALLS]") == "mistral"
    assert tc.style_of("{% if tools %}{{ tools | tojson }}{% endif %}") == "llama"


def test_the_stream_holds_back_anything_that_may_be_a_call():
    s = tc.ToolStream()
    assert s.feed("  ") == ""  # leading space: a bare JSON call may still come
    assert s.feed("Sure, ") == "  Sure, "
    assert s.feed("checking <tool") == "checking "  # "<tool" may start "<tool_call>"
    assert s.feed('_call>{"name"') == "" and s.held.startswith("<tool_call>")
    s2 = tc.ToolStream()
    assert s2.feed('{"name": "get_weather"') == ""  # a bare JSON call, Llama style
    s3 = tc.ToolStream()
    assert s3.feed("a <t") == "a " and s3.feed("ea") == "<tea"  # not a marker after all
    assert tc.ToolStream().feed("x [TOOL") == "x "


def test_a_forced_call_holds_only_the_keys_its_schema_declares(default_engine):
    # JSON Schema admits undeclared keys unless told otherwise; a forced call's grammar does
    # not, or a sampled small model invents keys until max_tokens (seen on the default model)
    open_obj = {"type": "object", "properties": {"city": {"type": "string"}},
                "required": ["city"]}
    extra = dict(open_obj, additionalProperties={"type": "integer"})
    tools = tc.check_tools("tools", [
        {"type": "function", "function": {"name": "w", "parameters": open_obj}},
        {"type": "function", "function": {"name": "x", "parameters": extra}}])
    assert tc.closed(open_obj)["additionalProperties"] is False
    assert "additionalProperties" not in open_obj  # the tool's own schema is left as it was
    nested = tc.closed({"type": "object", "properties": {"a": open_obj},
                        "$defs": {"d": open_obj}, "items": [open_obj]})
    assert all(s["additionalProperties"] is False
               for s in (nested["properties"]["a"], nested["$defs"]["d"], nested["items"][0]))
    for name, more, admitted in (("w", ',"temp":1', False), ("x", ',"temp":1', True)):
        c = tc.grammar(tools, name, parallel=False, style="hermes")
        args = f'{{"city":"Paris"{more}}}'
        call = f'<tool_call>\n{{"name":"{name}","arguments":{args}}}\n</tool_call>'
        ids = default_engine.tokenizer.encode(call, add_special_tokens=False)
        got = default_engine.grammars.matcher(c).accepts(ids)
        assert (got == len(ids)) is admitted, name
