"""OpenAI's Responses API (``POST /v1/responses``), text and function
calls, whole or streamed, as current OpenAI clients default to it.

A body's ``input`` (a string, or a list of items: messages whose content is
a string or ``input_text``/``output_text`` parts, and a conversation's
earlier ``function_call`` and ``function_call_output`` items) and
``instructions`` (a system message before it) go through the model's chat
template as a chat completion's messages would: an earlier call as an
assistant message's ``tool_calls``, its output as a ``role: tool`` message.
The rest maps onto the same sampling parameters. A field the API has and
kvrelay does not serve (stored responses, ``previous_response_id``,
background runs, reasoning, ...) is refused naming it
(`cluster.openai_protocol.parse_body`).

``tools`` are function tools in the Responses shape (``{"type": "function",
"name", "description", "parameters", "strict"}``) and ``tool_choice`` is
``none``, ``auto``, ``required`` or ``{"type": "function", "name": ...}``;
they take the chat path's `cluster.tools` (the template gets them, a forced
call is structured output, the parser reads calls out of the text). Each
call is an output item of type ``function_call`` (``call_id``, ``name``,
``arguments`` as JSON text), after the message item if there is text.

Streamed, the events are OpenAI's, in its order:

    response.created, response.in_progress,
    then per output item, a message:
      response.output_item.added, response.content_part.added,
      response.output_text.delta ...,
      response.output_text.done, response.content_part.done, response.output_item.done
    or a function call:
      response.output_item.added, response.function_call_arguments.delta ...,
      response.function_call_arguments.done, response.output_item.done
    response.completed (or response.incomplete at max_output_tokens)

Without tools the message item opens at once (empty text included); with
them, it opens with the first text, so a forced call is the only item.
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Any

from cluster import tools as tool_calls
from cluster.backend import Backend
from cluster.errors import quote
from cluster.openai_protocol import StreamOptions, _Body, chat_template
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
    tools: Any = None  # function tools (`parse_tools`)
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None


_TOOL_KEYS = {"type", "name", "description", "parameters", "strict"}
_CALL_KEYS = {"type", "call_id", "name", "arguments", "id", "status"}
_OUTPUT_KEYS = {"type", "call_id", "output", "id", "status"}


def parse_tools(body: ResponsesBody, backend: Backend, configured_format: str = "auto"
                ) -> tool_calls.ToolRequest | None:
    """The body's function tools and tool_choice as the chat path's `ToolRequest` (None without tools);
    raises `InvalidRequestError` naming the field as the Responses API spells it."""
    choice = body.tool_choice
    if body.tools is None:
        if choice not in (None, "none", "auto"):
            raise InvalidRequestError("tool_choice", "needs tools")
        return None
    if not isinstance(body.tools, list) or not body.tools:
        raise InvalidRequestError("tools", "must be a non-empty list of function tools")
    functions: list[tool_calls.Function] = []
    for i, tool in enumerate(body.tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            got = tool.get("type") if isinstance(tool, dict) else tool
            raise InvalidRequestError(f"{where}.type", f'only "function" tools are supported, got {quote(got)}')
        _only(tool, _TOOL_KEYS, where)
        if tool.get("strict") not in (None, True, False):
            raise InvalidRequestError(f"{where}.strict", "must be a boolean")
        functions.append(tool_calls.function_of(tool, where, functions))
    named = ""
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict) and choice.get("type") == "function":
        _only(choice, {"type", "name"}, "tool_choice")
        named = choice.get("name")
        if not any(f.name == named for f in functions):
            raise InvalidRequestError("tool_choice.name", f"{quote(named)} is not one of the tools")
        choice = "function"
    elif choice not in ("none", "auto", "required"):
        raise InvalidRequestError("tool_choice", 'must be "none", "auto", "required" or '
                                                 '{"type": "function", "name": ...}')
    fmt = tool_calls.tool_format(chat_template(backend.tokenizer), configured_format)
    return tool_calls.ToolRequest(tuple(functions), choice, fmt, named, body.parallel_tool_calls is not False)


def _only(item: dict, allowed: set[str], where: str) -> None:
    unknown = set(item) - allowed
    if unknown:
        raise InvalidRequestError(f"{where}.{sorted(unknown)[0]}", "not supported by this server")


def messages_of(body: ResponsesBody) -> list[dict]:
    """``instructions`` and ``input`` as chat messages for the template (`cluster.tools.chat_messages`):
    consecutive ``function_call`` items as one assistant message's ``tool_calls``, each
    ``function_call_output`` as a ``role: tool`` message."""
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
        kind = item.get("type", "message")
        if kind == "function_call":
            call = _function_call(item, where)
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls"):
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append(_function_call_output(item, where))
        elif kind == "message":
            out.append(_message(item, where))
        else:
            raise InvalidRequestError(f"{where}.type", "only message, function_call and function_call_output "
                                                       f"items are supported, got {quote(kind)}")
    return out


def _message(item: dict, where: str) -> dict:
    _only(item, {"type", "role", "content", "id", "status"}, where)
    role = _ROLES.get(item.get("role"))
    if role is None:
        raise InvalidRequestError(f"{where}.role", f"must be one of {', '.join(_ROLES)}, got "
                                                   f"{quote(item.get('role'))}")
    return {"role": role, "content": _text(item.get("content"), f"{where}.content")}


def _text(content: Any, where: str) -> str:
    if isinstance(content, list):
        bad = next((j for j, p in enumerate(content) if not (isinstance(p, dict) and p.get("type") in _TEXT_PARTS
                                                             and isinstance(p.get("text"), str))), None)
        if bad is not None:
            raise InvalidRequestError(f"{where}[{bad}]", "only input_text and output_text parts are supported")
        return "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise InvalidRequestError(where, "must be a string or a list of text parts")
    return content


def _function_call(item: dict, where: str) -> dict:
    """An earlier call of the conversation, in the chat shape the template path takes."""
    _only(item, _CALL_KEYS, where)
    for key in ("call_id", "name", "arguments"):
        if not isinstance(item.get(key), str):
            raise InvalidRequestError(f"{where}.{key}", "must be a string")
    try:
        json.loads(item["arguments"] or "{}")
    except json.JSONDecodeError:
        raise InvalidRequestError(f"{where}.arguments", "must be JSON text") from None
    return {"id": item["call_id"], "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]}}


def _function_call_output(item: dict, where: str) -> dict:
    _only(item, _OUTPUT_KEYS, where)
    if not isinstance(item.get("call_id"), str):
        raise InvalidRequestError(f"{where}.call_id", "must be a string")
    return {"role": "tool", "tool_call_id": item["call_id"], "content": _text(item.get("output"), f"{where}.output")}


def to_generate_request(body: ResponsesBody, backend: Backend, request_id: str,
                        tools: tool_calls.ToolRequest | None = None) -> GenerateRequest:
    """``tools``: the body's (`parse_tools`)."""
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
    messages, template_tools = tool_calls.chat_messages(messages_of(body), tools, chat_template(backend.tokenizer))
    token_ids = encode_chat(backend.tokenizer, messages, field="input", tools=template_tools)
    try:
        sampling = validate_request(token_ids, max_model_len=backend.max_model_len, vocab_size=backend.vocab_size,
                                    max_tokens=body.max_output_tokens, temperature=body.temperature,
                                    top_p=body.top_p, guided=tools.guided() if tools is not None else None,
                                    guided_field="tools")
    except InvalidRequestError as e:
        if e.field == "max_tokens":
            raise InvalidRequestError("max_output_tokens", e.problem.replace("max_tokens", "max_output_tokens")) \
                from None
        raise
    return GenerateRequest(request_id, token_ids, sampling)


class ResponseObjects:
    """The response object of one request and, streamed, its events in order.

    Non-streaming: ``response(text, ...)`` of the whole text. Streamed: ``opening()``, then ``delta(text)``
    for each delta's text, then ``closing(...)``; each returns the events to send. With tools, the text
    is read by the chat path's `ToolCallParser` into the message's text and ``function_call`` items.
    """

    def __init__(self, body: ResponsesBody, req: GenerateRequest, model: str,
                 tools: tool_calls.ToolRequest | None = None):
        self.body, self.req, self.model, self.tools = body, req, model, tools
        self.created_at = int(time.time())
        self.message_id = "msg_" + uuid.uuid4().hex
        self._sequence_number = 0
        self._parser = tool_calls.ToolCallParser(tools) if tools is not None and tools.choice != "none" else None
        # streamed: the output items so far, and which of them is still open
        self._items: list[dict] = []
        self._open: dict | None = None
        self._text = ""  # the open message's text so far

    def response(self, text: str | None, reason: FinishReason | None, num_output_tokens: int = 0,
                 num_cached_tokens: int = 0, output: list[dict] | None = None) -> dict:
        """The whole response: ``text`` None while it is in progress (no output yet); ``output``: the
        items, when they were made as the text streamed (else they are made from ``text``)."""
        status = "in_progress" if reason is None else "incomplete" if reason is FinishReason.LENGTH else "completed"
        if output is None:
            output = [] if text is None else self._output(text, status)
        b = self.body
        out = {"id": self.req.request_id, "object": "response", "created_at": self.created_at, "status": status,
               "model": self.model, "output": output,
               "error": None, "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
               "instructions": b.instructions, "max_output_tokens": b.max_output_tokens,
               "temperature": self.req.sampling.temperature, "top_p": self.req.sampling.top_p,
               "parallel_tool_calls": self.tools.parallel if self.tools is not None else False,
               "tool_choice": b.tool_choice if b.tool_choice is not None else "auto" if b.tools else "none",
               "tools": [dict(t, strict=t.get("strict")) for t in b.tools] if b.tools else [],
               "text": {"format": {"type": "text"}},
               "truncation": "disabled", "metadata": b.metadata or {}, "previous_response_id": None,
               "reasoning": None, "store": False, "user": b.user, "usage": None}
        if reason is not None:
            out["usage"] = {"input_tokens": self.req.num_prompt_tokens,
                            "input_tokens_details": {"cached_tokens": num_cached_tokens},
                            "output_tokens": num_output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                            "total_tokens": self.req.num_prompt_tokens + num_output_tokens}
        return out

    def _output(self, text: str, status: str) -> list[dict]:
        if self._parser is None:
            return [self.message(text, status)]
        content, _ = self._parser.feed(text)
        content += self._parser.finish()[0]
        calls = [self.function_call(c["id"], c["function"]["name"], c["function"]["arguments"], status)
                 for c in self._parser.calls]
        return ([self.message(content, status)] if content or not calls else []) + calls

    def message(self, text: str, status: str = "completed") -> dict:
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant",
                "content": [self.part(text)]}

    @staticmethod
    def function_call(call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
        return {"type": "function_call", "id": "fc_" + call_id.removeprefix("call_"), "call_id": call_id,
                "name": name, "arguments": arguments, "status": status}

    @staticmethod
    def part(text: str) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    # ---- the stream's events ------------------------------------------------
    def event(self, type_: str, **fields) -> dict:
        e = {"type": type_, "sequence_number": self._sequence_number, **fields}
        self._sequence_number += 1
        return e

    def opening(self) -> list[dict]:
        events = [self.event("response.created", response=self.response(None, None)),
                  self.event("response.in_progress", response=self.response(None, None))]
        if self._parser is None:  # the message is the one item: it opens at once
            events += self._open_message()
        return events

    def delta(self, text: str) -> list[dict]:
        """The events of a delta's ``text``."""
        if self._parser is None:
            return self._text_delta(text)
        content, calls = self._parser.feed(text)
        return self._parsed(content, calls)

    def closing(self, reason: FinishReason, num_output_tokens: int, num_cached_tokens: int) -> list[dict]:
        events = self._parsed(*self._parser.finish()) if self._parser is not None else []
        if not self._items and self._open is None:  # no text and no call: an empty message, as without tools
            events += self._open_message()
        events += self._close("incomplete" if reason is FinishReason.LENGTH else "completed")
        final = self.response(None, reason, num_output_tokens, num_cached_tokens, output=self._items)
        return events + [self.event("response.incomplete" if final["status"] == "incomplete"
                                    else "response.completed", response=final)]

    def _parsed(self, content: str, calls: list[dict]) -> list[dict]:
        events = self._text_delta(content) if content else []
        for call in calls:
            if "id" in call:  # a new call: the open item ends
                events += self._close()
                fn = call["function"]
                self._open = self.function_call(call["id"], fn["name"], "", "in_progress")
                events.append(self.event("response.output_item.added", output_index=len(self._items),
                                         item=dict(self._open)))
            piece = call["function"].get("arguments", "")
            if piece:
                self._open["arguments"] += piece
                events.append(self.event("response.function_call_arguments.delta", item_id=self._open["id"],
                                         output_index=len(self._items), delta=piece))
        return events

    def _text_delta(self, text: str) -> list[dict]:
        events = []
        if self._open is None or self._open["type"] != "message":
            events += self._close() + self._open_message()
        self._text += text
        return events + [self.event("response.output_text.delta", item_id=self._open["id"],
                                    output_index=len(self._items), content_index=0, delta=text, logprobs=[])]

    def _open_message(self) -> list[dict]:
        if self._items:  # a message after a call: an item of its own
            self.message_id = "msg_" + uuid.uuid4().hex
        self._open = dict(self.message("", "in_progress"), content=[])
        self._text = ""
        index = len(self._items)
        return [self.event("response.output_item.added", output_index=index, item=dict(self._open)),
                self.event("response.content_part.added", item_id=self._open["id"], output_index=index,
                           content_index=0, part=self.part(""))]

    def _close(self, status: str = "completed") -> list[dict]:
        """The events that end the open item, if any; it joins the output."""
        item, self._open = self._open, None
        if item is None:
            return []
        index = len(self._items)
        if item["type"] == "message":
            where = {"item_id": item["id"], "output_index": index, "content_index": 0}
            done = dict(self.message(self._text, status), id=item["id"])
            events = [self.event("response.output_text.done", **where, text=self._text, logprobs=[]),
                      self.event("response.content_part.done", **where, part=self.part(self._text))]
        else:
            done = dict(item, status=status)
            events = [self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                 name=item["name"], arguments=item["arguments"])]
        self._items.append(done)
        return events + [self.event("response.output_item.done", output_index=index, item=done)]
