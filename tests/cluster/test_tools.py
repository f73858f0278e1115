"""The tool-call parser and prompt, alone: what a client gets as ``tool_calls``
from each output format, whole and streamed in any split."""
from __future__ import annotations

import json

import pytest

from cluster.tools import ToolCallParser, chat_messages, parse_tools
from cluster.types import InvalidRequestError

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def run(parser: ToolCallParser, text: str, step: int) -> tuple[str, list[dict]]:
    """Feed ``text`` in pieces of ``step`` characters; the content and the calls rebuilt from the deltas."""
    content, calls = "", {}
    pieces = [text[i:i + step] for i in range(0, len(text), step)]
    for out in [parser.feed(p) for p in pieces] + [parser.finish()]:
        content += out[0]
        for d in out[1]:
            c = calls.setdefault(d["index"], {"name": "", "arguments": ""})
            if "id" in d:
                assert d["id"].startswith("call_") and d["type"] == "function"
                c["name"] = d["function"]["name"]
            c["arguments"] += d["function"].get("arguments", "")
    rebuilt = [calls[i] for i in sorted(calls)]
    assert rebuilt == [c["function"] for c in parser.calls]
    return content, rebuilt


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_hermes_calls_between_text(step):
    tools = parse_tools([WEATHER, TIME], "auto", "")
    text = ('Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
            '<tool_call>{"name": "get_time", "arguments": {}}</tool_call> Done <tool')
    content, calls = run(ToolCallParser(tools), text, step)
    assert content == "Let me look. Done <tool"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", {"city": "Paris"}),
                                                                         ("get_time", {})]


@pytest.mark.parametrize("step", [1, 1000])
def test_llama3_json_answer_is_calls_and_prose_is_content(step):
    tools = parse_tools([WEATHER, TIME], "auto", "... <|python_tag|> ...")
    assert tools.format == "llama3"
    content, calls = run(ToolCallParser(tools), '{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
                                                '{"name": "get_time", "parameters": {}}', step)
    assert content == "" and [c["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["arguments"]) == {"city": "Oslo"}
    tools = parse_tools([WEATHER], "auto", "<|python_tag|>")
    assert run(ToolCallParser(tools), "It is sunny.", step) == ("It is sunny.", [])


@pytest.mark.parametrize("step", [1, 2, 1000])
def test_forced_calls_stream_their_arguments(step):
    required = parse_tools([WEATHER, TIME], "required", "")
    content, calls = run(ToolCallParser(required), '{"name": "get_weather", "arguments": {"city": "Rome"}}', step)
    assert content == "" and calls == [{"name": "get_weather", "arguments": '{"city": "Rome"}'}]
    named = parse_tools([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}}, "")
    content, calls = run(ToolCallParser(named), '{"city": "Rome"}', step)
    assert calls == [{"name": "get_weather", "arguments": '{"city": "Rome"}'}]


def test_forced_schemas():
    required = parse_tools([WEATHER, TIME], "required", "").guided()
    schema = json.loads(required.value)
    assert [s["properties"]["name"] for s in schema["anyOf"]] == [{"enum": ["get_weather"]}, {"enum": ["get_time"]}]
    named = parse_tools([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, "").guided()
    assert json.loads(named.value) == WEATHER["function"]["parameters"]
    assert parse_tools([WEATHER], "auto", "").guided() is None


@pytest.mark.parametrize("tools, choice, field", [
    ([{"type": "retrieval"}], "auto", "tools[0].type"),
    ([{"type": "function", "function": {"name": "bad name"}}], "auto", "tools[0].function.name"),
    ([WEATHER, WEATHER], "auto", "tools[1].function.name"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice.function.name"),
    ([WEATHER], "sometimes", "tool_choice"),
    (None, "required", "tool_choice"),
])
def test_bad_tools_are_refused_naming_the_field(tools, choice, field):
    with pytest.raises(InvalidRequestError) as e:
        parse_tools(tools, choice, "")
    assert e.value.field == field


def test_a_template_without_tools_gets_them_as_a_system_message_and_calls_as_text():
    tools = parse_tools([WEATHER], "auto", "")
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}]
    out, template_tools = chat_messages(messages, tools, "{{ message['content'] }}")
    assert template_tools is None and out[0]["role"] == "system" and "get_weather" in out[0]["content"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' == out[2]["content"]
    assert out[3] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}
    out, template_tools = chat_messages(messages, tools, "{% for tool in tools %}...")
    assert template_tools == [WEATHER] and out[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}


def test_parallel_tool_calls_false_keeps_the_first_call():
    tools = parse_tools([WEATHER, TIME], "auto", "", parallel_tool_calls=False)
    text = ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
            '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    content, calls = run(ToolCallParser(tools), text, 1000)
    assert [c["name"] for c in calls] == ["get_weather"] and content == ""
