"""OpenAI's Responses API (``POST /v1/responses``), text in and text out,
whole or streamed, as current OpenAI clients default to it.

A body's ``input`` (a string, or a list of messages whose content is a
string or ``input_text``/``output_text`` parts) and ``instructions`` (a
system message before it) go through the model's chat template as a chat
completion's messages would; the rest maps onto the same sampling
parameters. A field the API has and kvrelay does not serve (stored
responses, ``previous_response_id``, background runs, reasoning, ...) is
refused naming it (`cluster.openai_protocol.parse_body`).

Streamed, the events are OpenAI's, in its order:

    response.created, response.in_progress,
    response.output_item.added, response.content_part.added,
    response.output_text.delta ...,
    response.output_text.done, response.content_part.done, response.output_item.done,
    response.completed (or response.incomplete at max_output_tokens)
"""
from __future__ import annotations

import time
import uuid
from typing import Any

from cluster.backend import Backend
from cluster.errors import quote
from cluster.openai_protocol import StreamOptions, _Body
from cluster.serving import encode_chat
from cluster.types import FinishReason, GenerateRequest, InvalidRequestError
from cluster.validation import check_model, validate_request

_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
_TEXT_PARTS = ("input_text", "output_text")


class TextFormat(_Body):
    type: str


class TextConfig(_Body):
    format: TextFormat | None = None
    verbosity: str | None = None


class ResponsesBody(_Body):
    model: str | None = None
    input: Any
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    text: TextConfig | None = None  # only the "text" format
    store: bool | None = None  # only false: kvrelay keeps no responses
    truncation: str | None = None  # only "disabled"
    metadata: dict[str, str] | None = None  # returned as given
    user: str | None = None  # for the operator's logs: no effect on the output
    safety_identifier: str | None = None


def messages_of(body: ResponsesBody) -> list[dict[str, str]]:
    """``instructions`` and ``input`` as chat messages for the template."""
    out = [{"role": "system", "content": body.instructions}] if body.instructions else []
    if isinstance(body.input, str):
        if not body.input:
            raise InvalidRequestError("input", "must not be empty")
        return out + [{"role": "user", "content": body.input}]
    if not isinstance(body.input, list) or not body.input:
        raise InvalidRequestError("input", "must be a string or a non-empty list of messages")
    for i, item in enumerate(body.input):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise InvalidRequestError(where, "must be a message object")
        if item.get("type", "message") != "message":
            raise InvalidRequestError(f"{where}.type", f"only messages are supported, got {quote(item['type'])}")
        unknown = set(item) - {"type", "role", "content", "id", "status"}
        if unknown:
            raise InvalidRequestError(f"{where}.{sorted(unknown)[0]}", "not supported by this server")
        role = _ROLES.get(item.get("role"))
        if role is None:
            raise InvalidRequestError(f"{where}.role", f"must be one of {', '.join(_ROLES)}, got "
                                                       f"{quote(item.get('role'))}")
        content = item.get("content")
        if isinstance(content, list):
            bad = next((j for j, p in enumerate(content) if not (isinstance(p, dict) and p.get("type") in _TEXT_PARTS
                                                                 and isinstance(p.get("text"), str))), None)
            if bad is not None:
                raise InvalidRequestError(f"{where}.content[{bad}]", "only input_text and output_text parts "
                                                                     "are supported")
            content = "".join(p["text"] for p in content)
        elif not isinstance(content, str):
            raise InvalidRequestError(f"{where}.content", "must be a string or a list of text parts")
        out.append({"role": role, "content": content})
    return out


def to_generate_request(body: ResponsesBody, backend: Backend, request_id: str) -> GenerateRequest:
    check_model(body.model or "", backend.model_name)
    if body.store:
        raise InvalidRequestError("store", "kvrelay keeps no responses: send store false or leave it out")
    if body.truncation not in (None, "disabled"):
        raise InvalidRequestError("truncation", f"only \"disabled\" is supported, got {quote(body.truncation)}")
    if body.text is not None and body.text.format is not None and body.text.format.type != "text":
        raise InvalidRequestError("text.format", f"only the text format is supported, got "
                                                 f"{quote(body.text.format.type)}")
    if body.text is not None and body.text.verbosity is not None:
        raise InvalidRequestError("text.verbosity", "not supported by this server")
    token_ids = encode_chat(backend.tokenizer, messages_of(body), field="input")
    try:
        sampling = validate_request(token_ids, max_model_len=backend.max_model_len, vocab_size=backend.vocab_size,
                                    max_tokens=body.max_output_tokens, temperature=body.temperature,
                                    top_p=body.top_p)
    except InvalidRequestError as e:
        if e.field == "max_tokens":
            raise InvalidRequestError("max_output_tokens", e.problem.replace("max_tokens", "max_output_tokens")) \
                from None
        raise
    return GenerateRequest(request_id, token_ids, sampling)


class ResponseObjects:
    """The response object of one request and, streamed, its events in order."""

    def __init__(self, body: ResponsesBody, req: GenerateRequest, model: str):
        self.body, self.req, self.model = body, req, model
        self.created_at = int(time.time())
        self.message_id = "msg_" + uuid.uuid4().hex
        self._sequence_number = 0

    def response(self, text: str | None, reason: FinishReason | None, num_output_tokens: int = 0,
                 num_cached_tokens: int = 0) -> dict:
        """The whole response: ``text`` None while it is in progress (no output yet)."""
        status = "in_progress" if reason is None else "incomplete" if reason is FinishReason.LENGTH else "completed"
        b = self.body
        out = {"id": self.req.request_id, "object": "response", "created_at": self.created_at, "status": status,
               "model": self.model, "output": [] if text is None else [self.message(text, status)],
               "error": None, "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
               "instructions": b.instructions, "max_output_tokens": b.max_output_tokens,
               "temperature": self.req.sampling.temperature, "top_p": self.req.sampling.top_p,
               "parallel_tool_calls": False, "tool_choice": "none", "tools": [], "text": {"format": {"type": "text"}},
               "truncation": "disabled", "metadata": b.metadata or {}, "previous_response_id": None,
               "reasoning": None, "store": False, "user": b.user, "usage": None}
        if reason is not None:
            out["usage"] = {"input_tokens": self.req.num_prompt_tokens,
                            "input_tokens_details": {"cached_tokens": num_cached_tokens},
                            "output_tokens": num_output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                            "total_tokens": self.req.num_prompt_tokens + num_output_tokens}
        return out

    def message(self, text: str, status: str = "completed") -> dict:
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant",
                "content": [self.part(text)]}

    @staticmethod
    def part(text: str) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    # ---- the stream's events ------------------------------------------------
    def event(self, type_: str, **fields) -> dict:
        e = {"type": type_, "sequence_number": self._sequence_number, **fields}
        self._sequence_number += 1
        return e

    def opening(self) -> list[dict]:
        item = dict(self.message("", "in_progress"), content=[])
        where = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
        return [self.event("response.created", response=self.response(None, None)),
                self.event("response.in_progress", response=self.response(None, None)),
                self.event("response.output_item.added", output_index=0, item=item),
                self.event("response.content_part.added", **where, part=self.part(""))]

    def delta(self, text: str) -> dict:
        return self.event("response.output_text.delta", item_id=self.message_id, output_index=0, content_index=0,
                          delta=text, logprobs=[])

    def closing(self, text: str, reason: FinishReason, num_output_tokens: int, num_cached_tokens: int) -> list[dict]:
        where = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
        final = self.response(text, reason, num_output_tokens, num_cached_tokens)
        return [self.event("response.output_text.done", **where, text=text, logprobs=[]),
                self.event("response.content_part.done", **where, part=self.part(text)),
                self.event("response.output_item.done", output_index=0, item=final["output"][0]),
                self.event("response.incomplete" if final["status"] == "incomplete" else "response.completed",
                           response=final)]
