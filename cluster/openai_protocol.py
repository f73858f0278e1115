"""OpenAI's request bodies, read into `GenerateRequest`s.

Bodies are pydantic models in strict mode that refuse a wrong type, naming
the field (``temperature: input should be a valid number``), and refuse any
field kvrelay does not implement (``logit_bias_mode: not supported by this
server``): a field is honoured or refused, never accepted and dropped.
`to_choices` turns a body into one `Choice` per answer the client gets (a
`GenerateRequest` each: a prompt of a list, times ``n``) through the shared
tokenization (`cluster.serving`) and validation (`cluster.validation`), with
its structured-output constraint (`cluster.structured`) and, for a chat, its
tools (`chat_tools`, `cluster.tools`). `cluster.openai_objects` builds the
response objects from `GenerateDelta`s; `cluster.http_frontend` serves them.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from cluster import tools as tool_calls
from cluster.backend import Backend, Tokenizer
from cluster.errors import quote
from cluster.serving import encode_bad_words, encode_chat, encode_text
from cluster.structured import guided_spec
from cluster.types import FinishReason, GenerateDelta, GenerateRequest, InvalidRequestError
from cluster.validation import check_model, truncate_prompt, validate_request
from engine.sampling import MAX_CHOICES, choice_seed


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Body):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # OpenAI pads chunks against side channels; kvrelay sends none

# MAX_CHOICES (engine.sampling) bounds n; a completion's list of prompts times n is bounded by MAX_RESPONSE_CHOICES
# (lm-evaluation-harness batches its requests as lists of prompts: --batch_size 64 sends 64). Each choice is a
# request of its own to the router, so a large list waits in its admission queue like as many clients would.
MAX_RESPONSE_CHOICES = 256


class _GenerateBody(_Body):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: Any = None  # a string or a list of strings, checked by `_stop_strings`
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    n: int | None = None  # choices per prompt
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    kvrelay_timeline: bool | None = None  # an extension: the request's timeline in the response
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM's extension
    logit_bias: dict[str, float] | None = None  # token id (as a string, JSON's keys) -> bias
    prompt_logprobs: int | None = None  # vLLM's extension: each choice's "prompt_logprobs", this many alternatives
    # vLLM's extensions (engine.sampling.SamplingParams)
    min_tokens: int | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: Any = None  # a list of words (checked by cluster.serving.encode_bad_words)
    truncate_prompt_tokens: int | None = None  # keep the prompt's last this many tokens (-1: as many as fit)
    user: str | None = None  # the end user's id, for the operator's logs: no effect on the output
    # structured output (cluster.structured): OpenAI's, and vLLM's extras
    response_format: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionBody(_GenerateBody):
    prompt: Any  # a string, a list of token ids, or a list of either (one choice each, times n)
    logprobs: int | None = None
    echo: bool | None = None  # the prompt's text before each choice's completion
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(_Body):
    role: str
    content: Any = None  # a string, or a list of {"type": "text", "text": ...} parts
    tool_calls: Any = None  # an assistant's earlier calls (cluster.tools)
    tool_call_id: str | None = None  # role "tool": the call it answers
    name: str | None = None


class ChatBody(_GenerateBody):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    safety_identifier: str | None = None  # like user: for the operator, no effect on the output
    modalities: list[str] | None = None  # only ["text"]
    tools: Any = None  # cluster.tools
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None


def chat_tools(body: ChatBody, backend: Backend, tool_format: str = "auto") -> tool_calls.ToolRequest | None:
    """The body's tools and tool_choice (`cluster.tools`); raises `InvalidRequestError` naming the field."""
    return tool_calls.parse_tools(body.tools, body.tool_choice, chat_template(backend.tokenizer), tool_format,
                                  body.parallel_tool_calls)


def chat_template(tokenizer: Tokenizer) -> str:
    template = getattr(tokenizer, "chat_template", None) or ""
    return template if isinstance(template, str) else str(template)


def parse_body(body_type: type[_Body], raw: bytes) -> Any:
    """The body as ``body_type``; raises `InvalidRequestError` naming the first bad field."""
    try:
        return body_type.model_validate_json(raw or b"{}")
    except ValidationError as err:
        e = err.errors()[0]
        if e["type"] == "json_invalid":
            raise InvalidRequestError("body", f"not valid JSON ({e['msg']})") from None
        loc = e["loc"]
        if not loc:
            raise InvalidRequestError("body", "must be a JSON object") from None
        field = "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else str(p)) for i, p in enumerate(loc))
        if e["type"] == "extra_forbidden":
            raise InvalidRequestError(field, "not supported by this server") from None
        msg = e["msg"]
        raise InvalidRequestError(field, msg[:1].lower() + msg[1:]) from None


# ---- body → GenerateRequest -------------------------------------------------------
_UNSUPPORTED = (("best_of", 1), ("suffix", ""))


@dataclass(frozen=True)
class Choice:
    """One answer of a response: its index, its request, and (echo) the prompt text before its completion."""

    index: int
    request: GenerateRequest
    prompt_index: int = 0  # the choices of one prompt share it (usage counts each prompt once)
    echo_text: str = ""
    # echo with max_tokens 0 (OpenAI's legacy way to score a prompt): the one token the request computes to
    # get there is not shown (`visible`)
    echo_only: bool = False

    def visible(self, delta: GenerateDelta) -> GenerateDelta:
        """What of ``delta`` the response shows: all of it, or (`echo_only`) none of its tokens, and
        "length" as the finish reason: no token was asked for."""
        if not self.echo_only:
            return delta
        reason = delta.finish_reason
        if reason not in (None, FinishReason.ERROR):
            reason = FinishReason.LENGTH
        return dataclasses.replace(delta, text="", token_ids=[], logprobs=None, finish_reason=reason, stop_reason=None)


def to_choices(body: CompletionBody | ChatBody, backend: Backend, request_id: str,
               tools: tool_calls.ToolRequest | None = None) -> list[Choice]:
    """The body's choices, each prompt's ``n`` in a row (index = prompt index * n + j). Choice j > 0 of a
    seeded request draws from its own stream (`choice_seed`), so choice 0 is what n=1 would give."""
    n = 1 if body.n is None else body.n
    if not 1 <= n <= MAX_CHOICES:
        raise InvalidRequestError("n", f"must be in [1, {MAX_CHOICES}], got {quote(n)}")
    prompts = [None] if isinstance(body, ChatBody) else _prompt_list(body.prompt)
    if len(prompts) * n > MAX_RESPONSE_CHOICES:
        raise InvalidRequestError("n" if n > 1 else "prompt", f"{len(prompts)} prompts times n={n} is more than "
                                                              f"{MAX_RESPONSE_CHOICES} choices")
    if len(prompts) * n > 1 and body.kvrelay_timeline:
        raise InvalidRequestError("kvrelay_timeline", "is given for one choice only (n=1, one prompt)")
    echo = isinstance(body, CompletionBody) and bool(body.echo)
    choices = []
    for i, prompt in enumerate(prompts):
        rid = request_id if len(prompts) * n == 1 else f"{request_id}-{i}"
        req = to_generate_request(body, backend, rid, prompt, tools)
        echo_text = (_echo_text(backend.tokenizer, None if body.truncate_prompt_tokens is not None else prompt,
                                req.prompt_token_ids) if echo else "")
        for j in range(n):
            sampling = req.sampling
            if j and sampling.seed is not None:
                sampling = dataclasses.replace(sampling, seed=choice_seed(sampling.seed, j))
            if j:  # choice 0 scores the prompt for all (it computes it; the others fork its blocks)
                sampling = dataclasses.replace(sampling, prompt_logprobs=None)
            if n > 1:  # choice j > 0 runs beside choice 0 and shares its prompt's blocks there
                req_j = dataclasses.replace(req, request_id=f"{rid}-{j}", sampling=sampling,
                                            fork_of=f"{rid}-0" if j else None)
            choices.append(Choice(i * n + j, req_j if n > 1 else req, i, echo_text, echo and body.max_tokens == 0))
    return choices


def _echo_text(tokenizer: Tokenizer, prompt: Any, token_ids: list[int]) -> str:
    if isinstance(prompt, str):
        return prompt
    decode = getattr(tokenizer, "decode", None)
    if decode is None:
        raise InvalidRequestError("echo", "of a token-id prompt needs a tokenizer that decodes")
    return decode(token_ids)


def _prompt_list(prompt: Any) -> list[Any]:
    """``prompt`` as a list of prompts, each a string or a list of token ids."""
    def is_ids(p) -> bool:
        return isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p)

    if isinstance(prompt, str) or is_ids(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) or (is_ids(p) and p) for p in prompt):
        return list(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        bad = next(i for i, p in enumerate(prompt) if not (isinstance(p, str) or (is_ids(p) and p)))
        raise InvalidRequestError(f"prompt[{bad}]", "must be a string or a non-empty list of token ids")
    raise InvalidRequestError("prompt", "must be a string, a list of token ids, or a list of either")


def to_generate_request(body: CompletionBody | ChatBody, backend: Backend, request_id: str,
                        prompt: Any = None, tools: tool_calls.ToolRequest | None = None) -> GenerateRequest:
    """Check, tokenize and validate a body (a completion's ``prompt``: one of its list; a chat's
    ``tools`` from `chat_tools`); raises
    `InvalidRequestError` (field ``model``: unknown model)."""
    check_model(body.model or "", backend.model_name)
    for name, default in _UNSUPPORTED:
        value = getattr(body, name, None)
        if value is not None and value != default:
            raise InvalidRequestError(name, f"not supported, got {quote(value)}")
    if isinstance(body, ChatBody) and body.modalities not in (None, ["text"]):
        raise InvalidRequestError("modalities", f"only [\"text\"] is supported, got {quote(body.modalities)}")
    guided, guided_field = guided_spec(body)
    if tools is not None and tools.is_forced:
        if guided is not None:
            raise InvalidRequestError(guided_field, f"cannot be combined with tool_choice {tools.choice!r}, "
                                                    "which constrains the output itself")
        guided, guided_field = tools.guided(), "tools"
    if isinstance(body, ChatBody):
        messages, template_tools = tool_calls.chat_messages(_chat_messages(body.messages), tools,
                                                            chat_template(backend.tokenizer))
        token_ids = encode_chat(backend.tokenizer, messages, tools=template_tools)
        max_tokens_field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        max_tokens = getattr(body, max_tokens_field)
        if body.top_logprobs is not None and not body.logprobs:
            raise InvalidRequestError("top_logprobs", "needs logprobs set to true")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        logprobs_field = "top_logprobs"
    else:
        token_ids = _prompt_token_ids(backend.tokenizer, body.prompt if prompt is None else prompt)
        max_tokens_field, max_tokens = "max_tokens", body.max_tokens
        if body.echo and max_tokens == 0:  # the prompt alone (with its logprobs): one token computed, none shown
            max_tokens = 1
        logprobs, logprobs_field = body.logprobs, "logprobs"
    prompt_logprobs = body.prompt_logprobs
    token_ids = truncate_prompt(token_ids, body.truncate_prompt_tokens, backend.max_model_len)
    if echo_logprobs(body) and 0 <= body.logprobs:  # (a bad logprobs is refused by its own name below)
        prompt_logprobs = max(prompt_logprobs or 0, body.logprobs)
    try:
        sampling = validate_request(
            token_ids, max_model_len=backend.max_model_len, vocab_size=backend.vocab_size,
            max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
            min_p=body.min_p, seed=body.seed, stop=_stop_strings(body.stop), stop_token_ids=body.stop_token_ids or (),
            ignore_eos=bool(body.ignore_eos), logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty, repetition_penalty=body.repetition_penalty,
            logit_bias=_logit_bias(body.logit_bias), guided=guided, guided_field=guided_field,
            min_tokens=body.min_tokens, include_stop_str_in_output=bool(body.include_stop_str_in_output),
            skip_special_tokens=body.skip_special_tokens is not False, allowed_token_ids=body.allowed_token_ids,
            bad_words_token_ids=encode_bad_words(backend.tokenizer, body.bad_words),
        )
    except InvalidRequestError as e:  # name the field as this body spells it
        renamed = {"max_tokens": max_tokens_field, "logprobs": logprobs_field}.get(e.field)
        if renamed and renamed != e.field:
            raise InvalidRequestError(renamed, e.problem.replace("max_tokens", renamed)) from None
        raise
    return GenerateRequest(request_id, token_ids, sampling, timeline=bool(body.kvrelay_timeline))


def echo_logprobs(body: CompletionBody | ChatBody) -> bool:
    """A completion that echoes its prompt with logprobs lists the prompt's tokens' logprobs first (as
    lm-evaluation-harness scores a continuation: ``echo``, ``logprobs`` 1, ``max_tokens`` 1)."""
    return isinstance(body, CompletionBody) and bool(body.echo) and body.logprobs is not None


def _prompt_token_ids(tokenizer: Tokenizer, prompt: Any) -> list[int]:
    """One prompt of `_prompt_list`."""
    if isinstance(prompt, str):
        return encode_text(tokenizer, prompt)
    return list(prompt)  # empty and out-of-vocabulary ids are refused by validate_request


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    out = {}
    for key, value in (bias or {}).items():
        try:
            token_id = int(key)
        except ValueError:
            raise InvalidRequestError("logit_bias", f"keys must be token ids, got {quote(key)}") from None
        out[token_id] = value
    return out


def _stop_strings(stop: Any) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return stop
    raise InvalidRequestError("stop", "must be a string or a list of strings")


def _chat_messages(messages: list[ChatMessage]) -> list[dict]:
    out = []
    for i, m in enumerate(messages):
        content = m.content
        if content is None:
            content = ""
        elif isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise InvalidRequestError(f"messages[{i}].content", "only text parts are supported")
            content = "\n".join(p["text"] for p in content)
        elif not isinstance(content, str):
            raise InvalidRequestError(f"messages[{i}].content", "must be a string or a list of text parts")
        message = {"role": m.role, "content": content}
        if m.tool_calls is not None:
            if not isinstance(m.tool_calls, list):
                raise InvalidRequestError(f"messages[{i}].tool_calls", "must be a list of calls")
            message["tool_calls"] = m.tool_calls
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            message["name"] = m.name
        out.append(message)
    return out
