"""Function calls on ``/v1/responses``, alone (no backend): the Responses
API's tools and tool_choice read into the chat path's `ToolRequest`, earlier
calls and their outputs as the template's messages, and the model's text
into ``function_call`` output items, whole and as OpenAI's stream of events
in any split of the text."""
from __future__ import annotations

import json

import pytest

from cluster.openai_responses import ResponseObjects, ResponsesBody, messages_of, parse_tools
from cluster.types import FinishReason, GenerateRequest
from engine.sampling import SamplingParams

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
           "strict": True}
TIME = {"type": "function", "name": "get_time", "parameters": None}


class _Backend:
    class tokenizer:  # noqa: N801  (what parse_tools reads of a tokenizer)
        chat_template = "{{ messages }}"


def _objects(tool_choice=None, tools=(WEATHER, TIME)) -> ResponseObjects:
    body = ResponsesBody(input="hi", tools=list(tools), tool_choice=tool_choice)
    return ResponseObjects(body, GenerateRequest("resp_1", [1, 2], SamplingParams()), "m",
                           parse_tools(body, _Backend))


def _stream(objects: ResponseObjects, text: str, step: int, reason=FinishReason.STOP) -> list[dict]:
    events = objects.opening()
    for i in range(0, len(text), step):
        events += objects.delta(text[i:i + step])
    return events + objects.closing(reason, 9, 0)


def test_tools_and_tool_choice_take_the_chat_paths_request():
    tools = parse_tools(ResponsesBody(input="x", tools=[WEATHER, TIME]), _Backend)
    assert tools.choice == "auto" and [f.name for f in tools.functions] == ["get_weather", "get_time"]
    assert tools.functions[1].parameters == {"type": "object", "properties": {}}
    named = parse_tools(ResponsesBody(input="x", tools=[WEATHER], tool_choice={"type": "function",
                                                                                "name": "get_weather"}), _Backend)
    assert named.choice == "function" and named.guided() is not None
    assert parse_tools(ResponsesBody(input="x"), _Backend) is None


def test_earlier_calls_and_their_outputs_become_the_templates_messages():
    body = ResponsesBody(input=[
        {"role": "user", "content": "Weather and time in Oslo?"},
        {"type": "function_call", "call_id": "call_a", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call", "call_id": "call_b", "name": "get_time", "arguments": "{}", "status": "completed"},
        {"type": "function_call_output", "call_id": "call_a", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_b", "output": [{"type": "input_text", "text": "noon"}]}])
    assert messages_of(body) == [
        {"role": "user", "content": "Weather and time in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
            {"id": "call_b", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_a", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_b", "content": "noon"}]


HERMES = ('Let me check.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
          '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')


def test_a_whole_answer_is_its_text_then_its_calls():
    out = _objects().response(HERMES, FinishReason.STOP, 9)
    message, weather, time_ = out["output"]
    assert message["type"] == "message" and message["content"][0]["text"] == "Let me check."
    assert [(c["type"], c["name"], json.loads(c["arguments"])) for c in (weather, time_)] == [
        ("function_call", "get_weather", {"city": "Paris"}), ("function_call", "get_time", {})]
    assert weather["call_id"].startswith("call_") and weather["id"].startswith("fc_")
    assert out["status"] == "completed" and out["tool_choice"] == "auto" and out["tools"][0]["name"] == "get_weather"
    only_calls = _objects().response(HERMES.removeprefix("Let me check."), FinishReason.STOP, 9)["output"]
    assert [i["type"] for i in only_calls] == ["function_call", "function_call"]


@pytest.mark.parametrize("step", [1, 4, 1000])
def test_streamed_calls_are_openais_events_in_order(step):
    events = _stream(_objects(), HERMES, step)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events if e["type"] not in ("response.output_text.delta",
                                                           "response.function_call_arguments.delta")]
    assert kinds == ["response.created", "response.in_progress",
                     "response.output_item.added", "response.content_part.added",
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.output_item.added", "response.function_call_arguments.done",
                     "response.output_item.done",
                     "response.output_item.added", "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]
    added = [e for e in events if e["type"] == "response.output_item.added"]
    assert [(e["output_index"], e["item"]["type"]) for e in added] == [(0, "message"), (1, "function_call"),
                                                                       (2, "function_call")]
    assert added[1]["item"]["arguments"] == "" and added[1]["item"]["status"] == "in_progress"
    args = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"
                   and e["output_index"] == 1)
    done = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert json.loads(args) == {"city": "Paris"} and done[0]["arguments"] == args
    assert done[0]["item_id"] == added[1]["item"]["id"] and done[0]["name"] == "get_weather"
    final = events[-1]["response"]
    assert final["output"][0]["content"][0]["text"] == "Let me check."
    assert [(i["name"], json.loads(i["arguments"])) for i in final["output"][1:]] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert final["output"][1] == dict(added[1]["item"], arguments=args, status="completed")
    assert [i["status"] for i in final["output"]] == ["completed"] * 3
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "Let me check."


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_a_forced_call_streams_its_arguments_as_the_only_item(step):
    text = '{"name": "get_weather", "arguments": {"city": "Rome"}}'
    events = _stream(_objects("required"), text, step)
    added = [e for e in events if e["type"] == "response.output_item.added"]
    assert [e["item"]["name"] for e in added] == ["get_weather"]
    pieces = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert json.loads("".join(pieces)) == {"city": "Rome"}
    (item,) = events[-1]["response"]["output"]
    assert item["type"] == "function_call" and json.loads(item["arguments"]) == {"city": "Rome"}
    named = _stream(_objects({"type": "function", "name": "get_time"}), "{}", step)
    (item,) = named[-1]["response"]["output"]
    assert (item["name"], item["arguments"]) == ("get_time", "{}")


def test_tool_choice_none_and_an_answer_without_calls_are_text():
    events = _stream(_objects("none"), "Hello.", 2)
    assert [i["type"] for i in events[-1]["response"]["output"]] == ["message"]
    events = _stream(_objects(), "", 1, FinishReason.LENGTH)
    (message,) = events[-1]["response"]["output"]
    assert message["content"][0]["text"] == "" and message["status"] == "incomplete"
    assert events[-1]["type"] == "response.incomplete"
