"""Structured output and tool calls with the official `openai` client against
a served cluster of the default model, disaggregated (the prefill replica
samples the first token under the grammar, the decode replica rebuilds it)
and colocated. SmolLM2-135M alone writes neither valid JSON nor tool calls;
guided, its output is valid every time. Every mode ends with all pools free."""
from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from tests.e2e.conftest import colocated_spec, disagg_spec, running_cluster

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
          "properties": {"name": {"type": "string", "pattern": "^[A-Z][a-z]{1,10}$"},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "city": {"enum": ["Paris", "Rome", "Oslo"]}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "pattern": "^[A-Z][a-z]{1,12}$"},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "pattern": "^[A-Z][a-z]{1,12}$"}}}}}
ASK = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
GREEDY = dict(temperature=0, max_tokens=48)


@pytest.fixture(scope="module", params=["disaggregated", "colocated"])
def served(request, ray_instance):
    spec = disagg_spec(1, 1) if request.param == "disaggregated" else colocated_spec(1)
    with running_cluster(spec) as rc:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{rc.http_port}/v1", api_key="unused", max_retries=0,
                               timeout=120)
        yield rc, client
        assert rc.wait_pools_free() == {rid: True for rid in rc.cluster.actors}


def test_json_schema_output_parses_and_validates(served):
    _, client = served
    r = client.chat.completions.create(
        model="", messages=[{"role": "user", "content": "Describe a person as JSON."}], **GREEDY,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    assert r.choices[0].finish_reason == "stop"
    stream = client.completions.create(model="", prompt="A person:", stream=True, temperature=0.8, seed=7,
                                       max_tokens=48, extra_body={"guided_json": PERSON})
    jsonschema.validate(json.loads("".join(c.choices[0].text for c in stream)), PERSON)


def test_guided_regex_and_choice_are_honoured(served):
    _, client = served
    r = client.completions.create(model="", prompt="My email address is", temperature=1.0, seed=3, max_tokens=24,
                                  extra_body={"guided_regex": r"[a-z]{3,8}@[a-z]{3,8}\.(com|org)"})
    assert re.fullmatch(r"[a-z]{3,8}@[a-z]{3,8}\.(com|org)", r.choices[0].text), r.choices[0].text
    r = client.chat.completions.create(model="", messages=[{"role": "user", "content": "Is the sky green?"}],
                                       **GREEDY, extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert r.choices[0].message.content in ("yes", "no")


def _check_call(call, tools_by_name):
    assert call.type == "function" and call.id.startswith("call_")
    schema = tools_by_name[call.function.name]["function"]["parameters"]
    jsonschema.validate(json.loads(call.function.arguments), schema)


def test_tool_choice_required_yields_a_valid_call(served):
    _, client = served
    by_name = {"get_weather": WEATHER, "get_time": TIME}
    r = client.chat.completions.create(model="", messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                       **GREEDY)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    _check_call(choice.message.tool_calls[0], by_name)

    calls, finish = {}, None
    for chunk in client.chat.completions.create(model="", messages=ASK, tools=[WEATHER, TIME],
                                                tool_choice="required", stream=True, **GREEDY):
        delta = chunk.choices[0].delta
        for d in delta.tool_calls or ():
            c = calls.setdefault(d.index, {"id": d.id, "name": "", "arguments": ""})
            c["name"] += d.function.name or ""
            c["arguments"] += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and list(calls) == [0]
    assert calls[0]["name"] == choice.message.tool_calls[0].function.name  # greedy: the same call
    assert calls[0]["arguments"] == choice.message.tool_calls[0].function.arguments


def test_a_named_function_is_called_with_valid_arguments(served):
    _, client = served
    r = client.chat.completions.create(model="", messages=ASK, tools=[WEATHER, TIME],
                                       tool_choice={"type": "function", "function": {"name": "get_time"}},
                                       **GREEDY)
    [call] = r.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    _check_call(call, {"get_time": TIME})


def test_a_tool_result_round_trips_through_the_template(served):
    _, client = served
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "clear"}'}]
    r = client.chat.completions.create(model="", messages=messages, tools=[WEATHER], tool_choice="none",
                                       max_tokens=8, temperature=0)
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls
    assert r.usage.prompt_tokens > 60  # the call and its result are in the prompt


@pytest.mark.parametrize("extra, param, problem", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format", "json: cannot be compiled"),
    ({"guided_regex": "[unclosed"}, "guided_regex", "regex: cannot be compiled"),
    ({"guided_choice": []}, "guided_choice", "must be a non-empty list"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "give one structured-output constraint"),
])
def test_a_bad_constraint_is_a_400_naming_it(served, extra, param, problem):
    _, client = served
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="", messages=ASK, max_tokens=4, extra_body=extra)
    assert e.value.body["param"] == param and problem in e.value.body["message"], e.value.body
