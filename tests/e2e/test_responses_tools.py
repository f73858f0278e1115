"""Function calls on ``/v1/responses`` with the official `openai` client
against a served cluster of the default model, disaggregated and colocated:
``tool_choice`` "required" and a named function yield a ``function_call``
item whose arguments are valid for the function's schema, whole and
streamed as OpenAI's events; a conversation's earlier call and its output
go through the chat template as a chat completion's would; tool fields
kvrelay does not take are refused naming them. Every pool is free after."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.e2e.test_structured import ASK, TIME, WEATHER, served  # noqa: F401  (both modes' clusters)

R_WEATHER = {"type": "function", **WEATHER["function"]}  # the Responses API's shape: no "function" wrapper
R_TIME = {"type": "function", **TIME["function"]}
SCHEMAS = {"get_weather": R_WEATHER["parameters"], "get_time": R_TIME["parameters"]}
QUESTION = ASK[0]["content"]
GREEDY = dict(temperature=0, max_output_tokens=48)


def _streamed_calls(events) -> list[dict]:
    """The function_call items rebuilt from the stream's events, checked against each other."""
    calls: dict[int, dict] = {}
    for e in events:
        if e.type == "response.output_item.added" and e.item.type == "function_call":
            calls[e.output_index] = {"id": e.item.id, "name": e.item.name, "arguments": ""}
        elif e.type == "response.function_call_arguments.delta":
            assert e.item_id == calls[e.output_index]["id"]
            calls[e.output_index]["arguments"] += e.delta
        elif e.type == "response.function_call_arguments.done":
            assert e.arguments == calls[e.output_index]["arguments"]
        elif e.type == "response.output_item.done" and e.item.type == "function_call":
            assert (e.item.name, e.item.arguments) == (calls[e.output_index]["name"],
                                                       calls[e.output_index]["arguments"])
    return [calls[i] for i in sorted(calls)]


def test_tool_choice_required_yields_a_schema_valid_function_call(served):
    _, client = served
    r = client.responses.create(model="", input=QUESTION, tools=[R_WEATHER, R_TIME], tool_choice="required",
                                **GREEDY)
    assert r.status == "completed"
    [call] = [item for item in r.output if item.type == "function_call"]
    assert call.call_id.startswith("call_") and call.name in SCHEMAS
    jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    events = list(client.responses.create(model="", input=QUESTION, tools=[R_WEATHER, R_TIME],
                                          tool_choice="required", stream=True, **GREEDY))
    assert events[-1].type == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    [streamed] = _streamed_calls(events)
    assert (streamed["name"], streamed["arguments"]) == (call.name, call.arguments)  # greedy: the same call
    [final] = events[-1].response.output
    assert final.type == "function_call" and final.arguments == call.arguments


def test_a_named_function_is_called_with_valid_arguments(served):
    _, client = served
    r = client.responses.create(model="", input=QUESTION, tools=[R_WEATHER, R_TIME],
                                tool_choice={"type": "function", "name": "get_time"}, **GREEDY)
    [call] = r.output
    assert call.type == "function_call" and call.name == "get_time"
    jsonschema.validate(json.loads(call.arguments), SCHEMAS["get_time"])
    events = list(client.responses.create(model="", input=QUESTION, tools=[R_WEATHER, R_TIME], stream=True,
                                          tool_choice={"type": "function", "name": "get_time"}, **GREEDY))
    assert [(c["name"], c["arguments"]) for c in _streamed_calls(events)] == [("get_time", call.arguments)]


def test_a_call_and_its_output_round_trip_as_a_chats_would(served):
    _, client = served
    arguments = '{"city": "Paris", "unit": "celsius"}'
    result = '{"temperature": 21, "sky": "clear"}'
    r = client.responses.create(model="", tools=[R_WEATHER], tool_choice="none", temperature=0, max_output_tokens=8,
                                input=[{"role": "user", "content": QUESTION},
                                       {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                                        "arguments": arguments},
                                       {"type": "function_call_output", "call_id": "call_1", "output": result}])
    chat = client.chat.completions.create(
        model="", tools=[WEATHER], tool_choice="none", temperature=0, max_tokens=8,
        messages=ASK + [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": result}])
    assert r.usage.input_tokens == chat.usage.prompt_tokens > 60  # the same prompt, call and result in it
    assert r.output_text == chat.choices[0].message.content and r.output_text
    assert [item.type for item in r.output] == ["message"]


@pytest.mark.parametrize("tools, tool_choice, param", [
    ([dict(R_WEATHER, cache_control={"type": "ephemeral"})], None, "tools[0].cache_control"),
    ([{"type": "file_search", "vector_store_ids": ["v"]}], None, "tools[0].type"),
    ([dict(R_WEATHER, parameters="a schema")], None, "tools[0].parameters"),
    ([R_WEATHER, R_WEATHER], None, "tools[1].name"),
    ([R_WEATHER], {"type": "function", "name": "get_time"}, "tool_choice.name"),
    ([R_WEATHER], "sometimes", "tool_choice"),
])
def test_unknown_or_invalid_tool_fields_are_refused_naming_them(served, tools, tool_choice, param):
    _, client = served
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="", input=QUESTION, tools=tools, max_output_tokens=4,
                                **({"tool_choice": tool_choice} if tool_choice is not None else {}))
    assert e.value.body["param"] == param, e.value.body
