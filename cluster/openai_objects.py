"""OpenAI's response objects, built from `GenerateDelta`s: a whole response or its stream's
chunks (`CompletionResponses`, `ChatResponses`), usage, error bodies and the model list.
`cluster.openai_protocol` reads the request bodies; `cluster.http_frontend` serves both."""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from cluster import tools as tool_calls
from cluster.backend import Tokenizer
from cluster.openai_protocol import ChatBody, CompletionBody, _GenerateBody
from cluster.types import FinishReason, TokenLogprob


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def usage(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int = 0) -> dict:
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens,
            "prompt_tokens_details": {"cached_tokens": num_cached_tokens}}


def token_text(tokenizer: Tokenizer) -> Callable[[int], str]:
    """id → the token's text, for logprobs (``token_id:<id>`` when the tokenizer cannot decode)."""
    decode = getattr(tokenizer, "decode", None)
    if decode is None:
        return lambda token_id: f"token_id:{token_id}"
    return lambda token_id: decode([token_id])


class _Responses:
    """The response objects of one request: the whole response, or its stream's chunks in order.

    Subclasses give the endpoint's names and its choice and logprobs shapes.
    Logprobs are included iff the request asked for them (``with_logprobs``).
    """

    body_type: type[_GenerateBody]
    id_prefix: str
    object_name: str
    chunk_object_name: str

    def __init__(self, request_id: str, model: str, text_of: Callable[[int], str], with_logprobs: bool,
                 include_usage: bool = False, index: int = 0, echo_logprobs: bool = False,
                 with_prompt_logprobs: bool = False):
        """``echo_logprobs``: the logprobs list the echoed prompt's tokens first (`echo_logprobs`);
        ``with_prompt_logprobs``: the objects carry vLLM's ``prompt_logprobs``. Both come from `set_prompt`."""
        self.request_id, self.model = request_id, model
        self.index = index  # of the choice these objects carry
        self.created = int(time.time())
        self._text_of = text_of
        self._with_logprobs = with_logprobs
        self.include_usage = include_usage  # streams: "usage": null on every chunk, then a usage chunk
        self._num_chunks = 0
        self._text_offset = 0  # of the next chunk's text in the completion
        self._echo_logprobs, self._with_prompt_logprobs = echo_logprobs, with_prompt_logprobs
        self._prompt: list[TokenLogprob] = []  # every prompt token's, the first's logprob None

    def set_prompt(self, prompt_token_ids: Sequence[int], lps: Sequence[TokenLogprob] | None) -> None:
        """The prompt's logprobs, as the first delta of its choice 0 carried them (one per token after the
        first; `GenerateDelta.prompt_logprobs`)."""
        if prompt_token_ids:
            self._prompt = [TokenLogprob(prompt_token_ids[0], None), *(lps or ())]

    def response(self, text: str, reason: FinishReason, lps: Sequence[TokenLogprob], usage_: dict) -> dict:
        if self._echo_logprobs:
            lps = [*self._prompt, *lps]
        choice = self._choice(text, _finish_reason(reason), self._logprobs(lps, 0) if self._with_logprobs else None)
        choices, extra = self._with_prompt([choice])
        return self._object(self.object_name, choices, **extra, usage=usage_)

    def chunk(self, text: str, reason: FinishReason | None, lps: Sequence[TokenLogprob]) -> dict:
        is_first = self._num_chunks == 0
        if is_first and self._echo_logprobs:
            lps = [*self._prompt, *lps]
        logprobs = self._logprobs(lps, self._text_offset) if self._with_logprobs else None
        choices, extra = [self._chunk_choice(text, _finish_reason(reason), logprobs, is_first=is_first)], {}
        self._num_chunks += 1
        self._text_offset += len(text)
        if is_first:
            choices, extra = self._with_prompt(choices)
        return self._object(self.chunk_object_name, choices, **extra,
                            **({"usage": None} if self.include_usage else {}))

    def _with_prompt(self, choices: list[dict]) -> tuple[list[dict], dict]:
        """(choices, top-level fields) with vLLM's ``prompt_logprobs`` where asked for: a completion's in
        its choice, a chat's beside the choices (as vLLM places them)."""
        return choices, {}

    def prompt_logprobs_field(self) -> list[dict | None]:
        """vLLM's shape: None for the first token, then for each a map of token id (a string) to its logprob,
        rank and text, holding the prompt's token and the top alternatives."""
        out: list[dict | None] = [None]
        for lp in self._prompt[1:]:
            entry = {str(t): {"logprob": p, "rank": r, "decoded_token": self._text_of(t)}
                     for r, (t, p) in enumerate(lp.top, 1)}
            entry[str(lp.token_id)] = {"logprob": lp.logprob, "rank": lp.rank,
                                       "decoded_token": self._text_of(lp.token_id)}
            out.append(entry)
        return out

    def usage_chunk(self, usage_: dict) -> dict:
        return self._object(self.chunk_object_name, [], usage=usage_)

    def _object(self, object_name: str, choices: list[dict], **extra) -> dict:
        return {"id": self.request_id, "object": object_name, "created": self.created, "model": self.model,
                "choices": choices, **extra}

    def _choice(self, text: str, reason: str | None, logprobs: dict | None) -> dict:
        raise NotImplementedError

    def _chunk_choice(self, text: str, reason: str | None, logprobs: dict | None, is_first: bool) -> dict:
        raise NotImplementedError

    def _logprobs(self, lps: Sequence[TokenLogprob], text_offset: int) -> dict:
        raise NotImplementedError


class CompletionResponses(_Responses):
    body_type = CompletionBody
    id_prefix = "cmpl-"
    object_name = chunk_object_name = "text_completion"

    def _choice(self, text, reason, logprobs):
        return {"index": self.index, "text": text, "logprobs": logprobs, "finish_reason": reason}

    def _chunk_choice(self, text, reason, logprobs, is_first):
        return self._choice(text, reason, logprobs)

    def _with_prompt(self, choices):
        if self._with_prompt_logprobs:
            choices = [dict(c, prompt_logprobs=self.prompt_logprobs_field()) for c in choices]
        return choices, {}

    def _logprobs(self, lps, text_offset):
        """Parallel lists; ``text_offset`` counts from the completion's start (with echo, the prompt's:
        its first token has no logprob, and null top_logprobs, as OpenAI's legacy API gives)."""
        tokens = [self._text_of(lp.token_id) for lp in lps]
        offsets = []
        for t in tokens:
            offsets.append(text_offset)
            text_offset += len(t)
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps],
                "top_logprobs": [None if lp.logprob is None else {self._text_of(t): p for t, p in lp.top}
                                 for lp in lps], "text_offset": offsets}


class ChatResponses(_Responses):
    body_type = ChatBody
    id_prefix = "chatcmpl-"
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def __init__(self, *args, tools: tool_calls.ToolRequest | None = None, **kwargs):
        """``tools``: the request's (`chat_tools`); with any but tool_choice "none", the output is
        parsed into ``tool_calls`` (streamed: as deltas), and a request that called ends with
        finish_reason ``tool_calls``."""
        super().__init__(*args, **kwargs)
        self._parser = tool_calls.ToolCallParser(tools) if tools is not None and tools.choice != "none" else None

    def _choice(self, text, reason, logprobs):
        message = {"role": "assistant", "content": text}
        if self._parser is not None:
            content, _ = self._parser.feed(text)
            content += self._parser.finish()[0]
            message["content"] = content or None
            if self._parser.made_calls:
                message["tool_calls"] = self._parser.calls
                reason = "tool_calls" if reason == "stop" else reason
        return {"index": self.index, "message": message, "logprobs": logprobs, "finish_reason": reason}

    def _with_prompt(self, choices):
        return choices, ({"prompt_logprobs": self.prompt_logprobs_field()} if self._with_prompt_logprobs else {})

    def _chunk_choice(self, text, reason, logprobs, is_first):
        delta = {"role": "assistant", "content": text} if is_first else {"content": text}
        if self._parser is not None:
            content, calls = self._parser.feed(text)
            if reason is not None:
                rest, more = self._parser.finish()
                content, calls = content + rest, calls + more
            delta["content"] = content or (None if calls else "")
            if calls:
                delta["tool_calls"] = calls
            if reason == "stop" and self._parser.made_calls:
                reason = "tool_calls"
        return {"index": self.index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}

    def _logprobs(self, lps, text_offset):
        def entry(token_id: int, logprob: float) -> dict:
            text = self._text_of(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, p) for t, p in lp.top]}
                            for lp in lps], "refusal": None}


CompletionOrChatResponses = CompletionResponses | ChatResponses  # either endpoint's objects


def _finish_reason(reason: FinishReason | None) -> str | None:
    return None if reason is None else reason.value  # stop, length; abort when the operator aborted


def model_list(model: str, max_model_len: int, created: int, root: str | None = None) -> dict:
    return {"object": "list", "data": [model_card(model, max_model_len, created, root)]}


def model_card(model: str, max_model_len: int, created: int, root: str | None = None) -> dict:
    """``root``: the served checkpoint's folder, tokenizer included (as vLLM's ``root``), for clients that
    need the tokenizer locally (``vllm bench serve --tokenizer``)."""
    return {"id": model, "object": "model", "created": created, "owned_by": "kvrelay", "root": root or model,
            "max_model_len": max_model_len}
