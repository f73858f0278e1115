"""How each structured-output field of a request body reads into a GuidedSpec,
and what is refused, naming the field."""
from __future__ import annotations

import json

import pytest

from cluster.openai_protocol import ChatBody, CompletionBody
from cluster.structured import guided_spec
from cluster.types import InvalidRequestError

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


def body(**fields) -> CompletionBody:
    return CompletionBody.model_validate_json(json.dumps({"prompt": "hi", **fields}))


@pytest.mark.parametrize("fields, kind, field", [
    ({}, None, ""),
    ({"response_format": {"type": "text"}}, None, ""),
    ({"response_format": {"type": "json_object"}}, "json_object", "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}}, "json",
     "response_format"),
    ({"guided_json": SCHEMA}, "json", "guided_json"),
    ({"guided_json": json.dumps(SCHEMA)}, "json", "guided_json"),
    ({"guided_regex": "[0-9]+"}, "regex", "guided_regex"),
    ({"guided_choice": ["a", "b"]}, "choice", "guided_choice"),
    ({"guided_grammar": 'root ::= "x"'}, "grammar", "guided_grammar"),
    ({"structured_outputs": {"json": SCHEMA}}, "json", "structured_outputs"),
    ({"structured_outputs": {"choice": ["a"]}}, "choice", "structured_outputs"),
    ({"structured_outputs": {"json_object": True}}, "json_object", "structured_outputs"),
])
def test_each_field_reads_into_its_spec(fields, kind, field):
    spec, named = guided_spec(body(**fields))
    assert (spec.kind if spec else None, named) == (kind, field)


def test_a_schema_keeps_its_property_order():
    spec, _ = guided_spec(body(guided_json={"properties": {"z": {}, "a": {}}}))
    assert list(json.loads(spec.value)["properties"]) == ["z", "a"]


@pytest.mark.parametrize("fields, field", [
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": "json"}, "response_format"),
    ({"guided_json": 3}, "guided_json"),
    ({"guided_json": "{nope"}, "guided_json"),
    ({"guided_choice": "a"}, "guided_choice"),
    ({"guided_regex": ""}, "guided_regex"),
    ({"structured_outputs": {"json": SCHEMA, "regex": "a"}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
])
def test_a_malformed_constraint_is_refused_naming_the_field(fields, field):
    with pytest.raises(InvalidRequestError) as e:
        guided_spec(body(**fields))
    assert e.value.field == field


def test_chat_bodies_read_the_same_fields():
    chat = ChatBody.model_validate_json(json.dumps({"messages": [], "guided_choice": ["x"]}))
    assert guided_spec(chat)[0].choices == ("x",)
