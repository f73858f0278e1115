"""Structured output as OpenAI and vLLM clients ask for it, read into one
`GuidedSpec` (engine.guided) for the request.

Accepted, at most one of them per request (two are refused, naming both):

    response_format      {"type": "text"} (no constraint), {"type": "json_object"},
                         {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}
    guided_json          a JSON schema (object or JSON text)       vLLM's extras, in the body
    guided_regex         a regular expression
    guided_choice        a list of strings: the output is one of them
    guided_grammar       an EBNF grammar (GBNF dialect: root ::= ...)
    structured_outputs   {"json": ..., "regex": ..., "choice": [...], "grammar": ..., "json_object": true}
                         (one key), vLLM's newer spelling

A malformed value raises `InvalidRequestError` naming the field; whether the
grammar engine can compile it is checked by `cluster.validation`.
"""
from __future__ import annotations

from typing import Any

from cluster.types import InvalidRequestError
from engine.guided import GuidedError, GuidedSpec

_VLLM_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
_STRUCTURED_KEYS = {"json": "guided_json", "regex": "guided_regex", "choice": "guided_choice",
                    "grammar": "guided_grammar", "json_object": "json_object"}


def guided_spec(body: Any) -> tuple[GuidedSpec | None, str]:
    """The body's structured-output constraint and the field that asked for it (None, "" when none)."""
    given = [(name, getattr(body, name, None)) for name in ("response_format", *_VLLM_FIELDS, "structured_outputs")]
    given = [(name, v) for name, v in given if v is not None and not (name == "response_format" and _is_text(v))]
    if not given:
        return None, ""
    if len(given) > 1:
        raise InvalidRequestError(given[1][0], f"give one structured-output constraint, not both "
                                               f"{given[0][0]} and {given[1][0]}")
    name, value = given[0]
    try:
        if name == "response_format":
            return _response_format(value), name
        if name == "structured_outputs":
            return _structured_outputs(value), name
        return _vllm(name, value, name), name
    except GuidedError as e:
        raise InvalidRequestError(name, str(e)) from None


def _is_text(value: Any) -> bool:
    return isinstance(value, dict) and value.get("type") == "text"


def _response_format(value: Any) -> GuidedSpec:
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise InvalidRequestError("response_format", 'must be an object with a "type"')
    kind = value["type"]
    if kind == "json_object":
        return GuidedSpec("json_object")
    if kind == "json_schema":
        js = value.get("json_schema")
        if not isinstance(js, dict):
            raise InvalidRequestError("response_format.json_schema", "must be an object with a schema")
        schema = js.get("schema", {"type": "object"})  # OpenAI: schema is optional
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequestError("response_format.json_schema.schema", "must be a JSON schema object")
        return GuidedSpec.json_schema(schema)
    raise InvalidRequestError("response_format.type", f"must be text, json_object or json_schema, got {kind!r}")


def _structured_outputs(value: Any) -> GuidedSpec:
    keys = [k for k in (value or {}) if value[k] is not None] if isinstance(value, dict) else None
    if not keys or len(keys) != 1 or keys[0] not in _STRUCTURED_KEYS:
        raise InvalidRequestError("structured_outputs", f"must be an object with one of "
                                                        f"{', '.join(_STRUCTURED_KEYS)}")
    key = keys[0]
    if key == "json_object":
        return GuidedSpec("json_object")
    return _vllm(_STRUCTURED_KEYS[key], value[key], f"structured_outputs.{key}")


def _vllm(name: str, value: Any, field: str) -> GuidedSpec:
    if name == "guided_json":
        if not isinstance(value, (dict, str, bool)):
            raise InvalidRequestError(field, "must be a JSON schema (an object or JSON text)")
        return GuidedSpec.json_schema(value)
    if name == "guided_choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise InvalidRequestError(field, "must be a non-empty list of non-empty strings")
        return GuidedSpec("choice", choices=tuple(value))
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(field, "must be a non-empty string")
    return GuidedSpec("regex" if name == "guided_regex" else "grammar", value)
