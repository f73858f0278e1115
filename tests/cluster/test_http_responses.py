"""``POST /v1/responses`` through the official `openai` client's
``responses.create``, whole and streamed, over the EchoBackend (which echoes
the prompt's tokens: the chat template's ids of ``instructions`` + ``input``)."""
from __future__ import annotations

import openai
import pytest

from tests.cluster.test_http import echo_http, served  # noqa: F401  (the echo frontends, as fixtures)


def test_a_string_input_goes_through_the_chat_template(served):
    r = served.client().responses.create(model="echo", input="hello", max_output_tokens=40, temperature=0)
    assert r.status == "completed" and r.output_text == "<s> <|user|> hello <|assistant|> "
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (4, 4, 8)
    assert r.id.startswith("resp_") and r.output[0].role == "assistant"
    (req,) = served.backend.requests
    assert req.prompt_token_ids == [1, 4, 6, 5] and req.sampling.temperature == 0 and req.sampling.max_tokens == 40


def test_instructions_and_a_message_list(served):
    r = served.client().responses.create(
        model="echo", instructions="a cat", max_output_tokens=40,
        input=[{"role": "developer", "content": "the"},
               {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hello"}]}])
    assert r.output_text == "<s> <|system|> a cat <|system|> the <|user|> hello <|assistant|> "
    assert r.instructions == "a cat"


def test_max_output_tokens_makes_it_incomplete(served):
    r = served.client().responses.create(model="echo", input="hello world", max_output_tokens=2)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text == "<s> <|user|> " and r.usage.output_tokens == 2


def test_streamed_events_come_in_openais_order_and_add_up(served):
    events = list(served.client().responses.create(model="echo", input="hello", max_output_tokens=40, stream=True))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert set(types[4:-4]) == {"response.output_text.delta"} and len(types[4:-4]) == 4
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-4].text == events[-1].response.output_text == "<s> <|user|> hello <|assistant|> "
    assert events[-1].response.usage.output_tokens == 4


def test_a_failure_mid_stream_is_an_error_event(served):
    served.backend.error_after = 2
    events = list(served.client().responses.create(model="echo", input="hello", max_output_tokens=40, stream=True))
    assert events[-1].type == "error" and "died mid-stream" in events[-1].message
    assert [e.type for e in events].count("response.output_text.delta") == 2


@pytest.mark.parametrize("kwargs, param", [
    (dict(input=""), "input"),
    (dict(input=[]), "input"),
    (dict(input=[{"type": "reasoning", "summary": []}]), "input[0].type"),
    (dict(input=[{"type": "function_call_output", "call_id": "c", "output": "x", "extra": 1}]), "input[0].extra"),
    (dict(input=[{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]), "input[0].arguments"),
    (dict(input=[{"role": "critic", "content": "x"}]), "input[0].role"),
    (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]), "input[0].content[0]"),
    (dict(input="hello", store=True), "store"),
    (dict(input="hello", previous_response_id="resp_1"), "previous_response_id"),
    (dict(input="hello", reasoning={"effort": "low"}), "reasoning"),
    (dict(input="hello", background=True), "background"),
    (dict(input="hello", tools=[{"type": "web_search"}]), "tools[0].type"),
    (dict(input="hello", tools=[{"type": "function", "name": "f", "parameters": {}, "cache": 1}]), "tools[0].cache"),
    (dict(input="hello", tools=[{"type": "function", "name": "f g"}]), "tools[0].name"),
    (dict(input="hello", tools=[{"type": "function", "name": "f", "parameters": []}]), "tools[0].parameters"),
    (dict(input="hello", tools=[{"type": "function", "name": "f"}], tool_choice={"type": "function", "name": "g"}),
     "tool_choice.name"),
    (dict(input="hello", tool_choice="required"), "tool_choice"),
    (dict(input="hello", text={"format": {"type": "json_object"}}), "text.format"),
    (dict(input="hello", truncation="auto"), "truncation"),
    (dict(input="hello", max_output_tokens=0), "max_output_tokens"),
    (dict(input="hello", temperature=-1), "temperature"),
])
def test_what_it_does_not_serve_is_refused_naming_the_field(served, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        served.client().responses.create(model="echo", **kwargs)
    assert info.value.param == param, info.value.message
    assert not served.backend.requests


def test_the_responses_schema_is_decided_field_by_field():
    """Each field of the installed client's request type is honoured or in the refused list."""
    from openai.types.responses import response_create_params

    from cluster.openai_responses import ResponsesBody

    honoured = set(ResponsesBody.model_fields)
    refused = {"background", "background_options", "context_management", "conversation", "include",
               "max_tool_calls", "previous_response_id", "prompt", "prompt_cache_key",
               "prompt_cache_options", "prompt_cache_retention", "reasoning", "service_tier",
               "top_logprobs", "access_programs", "image", "moderation"}
    schema = set(response_create_params.ResponseCreateParamsBase.__annotations__) | {"stream"}
    assert schema <= honoured | refused, sorted(schema - honoured - refused)
    assert not honoured & refused
