"""Tool calls on /v1/chat/completions: OpenAI's ``tools`` and ``tool_choice``
through the model's chat template, and the model's output read back into
``tool_calls``, whole or streamed as deltas.

Two output formats, chosen by ``frontend.tool_call_format`` in the spec or,
when that is ``auto``, by the chat template (one that mentions
``<|python_tag|>`` is Llama 3's, anything else Hermes/Qwen's):

    hermes   <tool_call>{"name": "f", "arguments": {...}}</tool_call>, any number, text around them
    llama3   {"name": "f", "parameters": {...}} as the whole answer (several joined by ";")

``tool_choice``:

    none       the template gets no tools; the output is text
    auto       the template gets the tools; calls are parsed out of the output
    required   structured output: the answer is one call object, {"name": <one of the tools>,
               "arguments" (llama3: "parameters"): <that tool's parameters schema>}
    {"type": "function", "function": {"name": "f"}}
               structured output: the answer is f's arguments, valid for its parameters schema

A template that ignores tools (SmolLM2's, say: it renders only role and
content) gets them as a system message in the chosen format, and earlier
assistant tool calls as text in that format, so the model sees them anyway.
Assistant messages with ``tool_calls`` and ``role: tool`` messages go
through the template as the template expects them (arguments as objects).
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from cluster.types import InvalidRequestError
from engine.guided import GuidedSpec

FORMATS = ("auto", "hermes", "llama3")
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
# the start of a forced call object up to its arguments: {"name": "f", "arguments":
_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\S)')


@dataclass(frozen=True)
class Function:
    name: str
    description: str = ""
    parameters: dict = field(default_factory=lambda: {"type": "object", "properties": {}})

    def as_tool(self) -> dict:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass(frozen=True)
class ToolRequest:
    """A chat request's tools, what it lets the model do with them, and the output format."""

    functions: tuple[Function, ...]
    choice: str  # none | auto | required | function
    format: str  # hermes | llama3
    named: str = ""  # choice "function": the function's name
    parallel: bool = True  # parallel_tool_calls: False keeps only the first call of an answer

    @property
    def is_forced(self) -> bool:
        return self.choice in ("required", "function")

    @property
    def args_key(self) -> str:
        return "parameters" if self.format == "llama3" else "arguments"

    def guided(self) -> GuidedSpec | None:
        """Structured output for a forced call: one call object, or the named function's arguments."""
        if self.choice == "function":
            return GuidedSpec.json_schema(self.function(self.named).parameters)
        if self.choice != "required":
            return None
        calls = [{"type": "object", "additionalProperties": False, "required": ["name", self.args_key],
                  "properties": {"name": {"enum": [f.name]}, self.args_key: f.parameters}}
                 for f in self.functions]
        return GuidedSpec.json_schema(calls[0] if len(calls) == 1 else {"anyOf": calls})

    def function(self, name: str) -> Function:
        return next(f for f in self.functions if f.name == name)


def parse_tools(tools: Any, tool_choice: Any, chat_template: str, configured_format: str = "auto",
                parallel_tool_calls: bool | None = None) -> ToolRequest | None:
    """The request's `ToolRequest` (None without tools); raises `InvalidRequestError` naming the field."""
    if tools is None:
        if tool_choice not in (None, "none", "auto"):
            raise InvalidRequestError("tool_choice", "needs tools")
        return None
    if not isinstance(tools, list) or not tools:
        raise InvalidRequestError("tools", "must be a non-empty list of function tools")
    functions = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise InvalidRequestError(f"tools[{i}].type", 'only "function" tools are supported')
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise InvalidRequestError(f"tools[{i}].function", "must be an object with a name")
        functions.append(function_of(fn, f"tools[{i}].function", functions))
    choice, named = _choice(tool_choice, functions)
    return ToolRequest(tuple(functions), choice, tool_format(chat_template, configured_format), named,
                       parallel_tool_calls is not False)


def function_of(fn: dict, where: str, defined: list[Function]) -> Function:
    """A function definition's ``name``, ``description`` and ``parameters`` (the fields at ``where``) as a
    `Function`; raises `InvalidRequestError` naming the field (a name already in ``defined`` too)."""
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidRequestError(f"{where}.name", "must be 1-64 letters, digits, _ . or -")
    if any(f.name == name for f in defined):
        raise InvalidRequestError(f"{where}.name", f"{name!r} is defined twice")
    params = fn.get("parameters")
    params = {"type": "object", "properties": {}} if params is None else params
    if not isinstance(params, dict):
        raise InvalidRequestError(f"{where}.parameters", "must be a JSON schema object")
    description = fn.get("description") or ""
    if not isinstance(description, str):
        raise InvalidRequestError(f"{where}.description", "must be a string")
    return Function(name, description, params)


def _choice(tool_choice: Any, functions: list[Function]) -> tuple[str, str]:
    if tool_choice is None:
        return "auto", ""
    if tool_choice in ("none", "auto", "required"):
        return tool_choice, ""
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        if not any(f.name == name for f in functions):
            raise InvalidRequestError("tool_choice.function.name", f"{name!r} is not one of the tools")
        return "function", name
    raise InvalidRequestError("tool_choice", 'must be "none", "auto", "required" or '
                                             '{"type": "function", "function": {"name": ...}}')


def tool_format(chat_template: str, configured: str = "auto") -> str:
    if configured != "auto":
        return configured
    return "llama3" if _PYTHON_TAG in chat_template else "hermes"


def template_takes_tools(chat_template: str) -> bool:
    return "tools" in chat_template


# ---- the prompt ------------------------------------------------------------------
def chat_messages(messages: list[dict], tools: ToolRequest | None,
                  chat_template: str) -> tuple[list[dict], list | None]:
    """The messages and the ``tools`` argument for the chat template.

    ``messages``: ``{"role", "content", "tool_calls"?, "tool_call_id"?, "name"?}``
    with ``tool_calls`` in OpenAI's shape (arguments as JSON text).
    """
    fmt = tools.format if tools is not None else tool_format(chat_template)
    native = template_takes_tools(chat_template)
    out = []
    for i, m in enumerate(messages):
        m = dict(m)
        calls = m.pop("tool_calls", None)
        if calls:
            parsed = [_template_call(c, f"messages[{i}].tool_calls[{j}]") for j, c in enumerate(calls)]
            if native:
                m["tool_calls"] = [{"type": "function", "id": c.get("id", ""), "function": p}
                                   for c, p in zip(calls, parsed)]
            else:
                m["content"] = "\n".join(filter(None, [m.get("content") or "",
                                                        *(_render_call(p, fmt) for p in parsed)]))
        out.append(m)
    offered = tools is not None and tools.choice != "none"
    if not offered:
        return out, None
    if native:
        return out, [f.as_tool() for f in tools.functions]
    prompt = _tools_prompt(tools)
    if out and out[0]["role"] == "system":
        out[0] = dict(out[0], content=f"{out[0]['content']}\n\n{prompt}")
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out, None


def _template_call(call: Any, field: str) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise InvalidRequestError(field, "must be {\"type\": \"function\", \"function\": {\"name\", \"arguments\"}}")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args or "{}")
        except json.JSONDecodeError:
            raise InvalidRequestError(f"{field}.function.arguments", "must be JSON text") from None
    return {"name": fn["name"], "arguments": args}


def _render_call(call: dict, fmt: str) -> str:
    if fmt == "llama3":
        return json.dumps({"name": call["name"], "parameters": call["arguments"]})
    return f"{_OPEN}\n{json.dumps(call)}\n{_CLOSE}"


def _tools_prompt(tools: ToolRequest) -> str:
    listing = "\n".join(json.dumps(f.as_tool()["function"]) for f in tools.functions)
    if tools.format == "llama3":
        how = ('To call a function, answer with only a JSON object of the form '
               '{"name": "<function name>", "parameters": {<its arguments>}}.')
    else:
        how = ('To call a function, write a JSON object of the form {"name": "<function name>", '
               f'"arguments": {{<its arguments>}}}} between {_OPEN} and {_CLOSE}.')
    return f"You can call these functions, described as JSON schemas:\n{listing}\n{how}"


# ---- the output ------------------------------------------------------------------
def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(index: int, name: str, arguments: str) -> dict:
    return {"index": index, "id": new_call_id(), "type": "function",
            "function": {"name": name, "arguments": arguments}}


class ToolCallParser:
    """The model's output, fed as it streams, into content and tool calls.

    ``feed(text)`` returns what may be sent now: ``(content, call_deltas)``,
    each call delta in OpenAI's streaming shape (``index``; ``id``, ``type``
    and the name on a call's first delta; pieces of ``arguments`` after).
    ``finish()`` returns the rest. ``calls`` holds the whole calls so far.
    """

    def __init__(self, tools: ToolRequest):
        self.tools = tools
        self.calls: list[dict] = []  # {"id", "type", "function": {"name", "arguments"}}
        self._buf = ""
        self._in_call = False  # forced: past the head, streaming arguments; hermes: inside <tool_call>
        self._held = ""  # forced required: the last characters, which may be the call object's closing brace

    @property
    def made_calls(self) -> bool:
        return bool(self.calls)

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self._buf += text
        if self.tools.is_forced:
            return "", self._feed_forced()
        if self.tools.format == "hermes":
            return self._feed_hermes()
        return self._feed_llama3()

    def finish(self) -> tuple[str, list[dict]]:
        if self.tools.is_forced:
            deltas = self._feed_forced()
            if self.tools.choice == "required" and self._in_call:
                tail = self._held.rstrip()
                tail = tail[:-1] if tail.endswith("}") else tail  # the call object's own closing brace
                self._held = ""
                deltas += self._args_delta(tail)
            elif not self._in_call and self._buf:  # cut before the arguments began (max_tokens)
                deltas += self._start(self._buf, "")
                self._buf = ""
            return "", deltas
        if self.tools.format == "llama3" and self._in_call:
            return self._parse_llama3(self._buf)
        rest, self._buf = self._buf, ""
        return rest, []

    # forced: the output is the arguments (named) or one call object (required)
    def _feed_forced(self) -> list[dict]:
        deltas = []
        if not self._in_call:
            if self.tools.choice == "function":
                deltas += self._start(self.tools.named, "")
            else:
                head = _CALL_HEAD.match(self._buf)
                if head is None:
                    return []
                deltas += self._start(json.loads(f'"{head.group(1)}"'), "")
                self._buf = self._buf[head.end():]
            self._in_call = True
        if self.tools.choice == "function":
            piece, self._buf = self._buf, ""
        else:  # hold back the last characters: the closing brace of the call object comes last
            self._held += self._buf
            self._buf = ""
            keep = len(self._held) - len(self._held.rstrip()) + 1
            piece, self._held = self._held[:-keep], self._held[-keep:]
        return deltas + self._args_delta(piece)

    def _start(self, name: str, arguments: str) -> list[dict]:
        if self.calls and not self.tools.parallel:  # parallel_tool_calls false: the first call only
            return []
        delta = _call(len(self.calls), name, arguments)
        self.calls.append({"id": delta["id"], "type": "function", "function": {"name": name, "arguments": arguments}})
        return [delta]

    def _args_delta(self, piece: str) -> list[dict]:
        if not piece or not self.calls:
            return []
        self.calls[-1]["function"]["arguments"] += piece
        return [{"index": len(self.calls) - 1, "function": {"arguments": piece}}]

    # hermes: text, and calls between <tool_call> and </tool_call>
    def _feed_hermes(self) -> tuple[str, list[dict]]:
        content, deltas = "", []
        while True:
            if self._in_call:
                end = self._buf.find(_CLOSE)
                if end < 0:
                    return content, deltas
                body, self._buf = self._buf[:end], self._buf[end + len(_CLOSE):]
                self._in_call = False
                call = _parse_call(body, "arguments")
                if call is None:  # not a call after all: it is text
                    content += f"{_OPEN}{body}{_CLOSE}"
                else:
                    deltas += self._start(call[0], call[1])
                continue
            start = self._buf.find(_OPEN)
            if start >= 0:
                content += self._buf[:start]
                self._buf = self._buf[start + len(_OPEN):]
                self._in_call = True
                continue
            keep = _partial_suffix(self._buf, _OPEN)  # may be the start of a tag: held back
            content += self._buf[:len(self._buf) - keep]
            self._buf = self._buf[len(self._buf) - keep:]
            return content, deltas

    # llama3: an answer that starts with a JSON object is calls, read when it ends
    def _feed_llama3(self) -> tuple[str, list[dict]]:
        if self._in_call:
            return "", []
        stripped = self._buf.lstrip()
        if not stripped or _PYTHON_TAG.startswith(stripped):
            return "", []
        if stripped.startswith("{") or stripped.startswith(_PYTHON_TAG):
            self._in_call = True
            return "", []
        content, self._buf = self._buf, ""
        return content, []

    def _parse_llama3(self, text: str) -> tuple[str, list[dict]]:
        self._buf = ""
        body = text.strip().removeprefix(_PYTHON_TAG)
        calls = [_parse_call(part, "parameters") for part in _split_objects(body)]
        if not calls or any(c is None for c in calls):
            return text, []
        deltas = []
        for name, args in calls:
            deltas += self._start(name, args)
        return "", deltas


def _parse_call(text: str, args_key: str) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a call object, or None if it is not one."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    return obj["name"], args if isinstance(args, str) else json.dumps(args)


def _split_objects(text: str) -> list[str]:
    """Llama 3's calls, ';'-separated JSON objects (a ';' inside a string stays)."""
    decoder, parts, i = json.JSONDecoder(), [], 0
    while i < len(text):
        while i < len(text) and text[i] in " \t\n;":
            i += 1
        if i >= len(text):
            break
        try:
            _, end = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return [text[i:]]
        parts.append(text[i:end])
        i = end
    return parts


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
