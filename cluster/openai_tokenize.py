"""``/tokenize`` and ``/detokenize`` as vLLM serves them.

    POST /tokenize    {"prompt": "..."} or {"messages": [...]}, optional "model",
                      "add_special_tokens" (default: true for a prompt, false for
                      messages, whose template holds any BOS), "add_generation_prompt"
                      (messages, default true), "return_token_strs" (default false)
                      -> {"count": n, "max_model_len": m, "tokens": [...], "token_strs": [...] | null}
    POST /detokenize  {"tokens": [...], optional "model"} -> {"prompt": "..."}

The same tokenizer and chat template as a generation request, so the ids
are those a completion of the same prompt would compute.
"""
from __future__ import annotations

from cluster.backend import Backend
from cluster.openai_objects import token_text
from cluster.openai_protocol import ChatMessage, _Body, _chat_messages
from cluster.types import InvalidRequestError
from cluster.validation import check_model


class TokenizeBody(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None
    return_token_strs: bool | None = None


class DetokenizeBody(_Body):
    model: str | None = None
    tokens: list[int]


def tokenize(body: TokenizeBody, backend: Backend) -> dict:
    check_model(body.model or "", backend.model_name)
    tok = backend.tokenizer
    if (body.prompt is None) == (body.messages is None):
        raise InvalidRequestError("prompt", "give exactly one of prompt and messages")
    if body.prompt is not None:
        if body.add_generation_prompt is not None:
            raise InvalidRequestError("add_generation_prompt", "applies to messages, not to a prompt")
        ids = tok.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
    else:
        if not body.messages:
            raise InvalidRequestError("messages", "must hold at least one message")
        text = tok.apply_chat_template(_chat_messages(body.messages), add_generation_prompt=body.add_generation_prompt
                                       is not False, tokenize=False)
        ids = tok.encode(text, add_special_tokens=bool(body.add_special_tokens))
    ids = list(ids)
    text_of = token_text(tok)
    return {"count": len(ids), "max_model_len": backend.max_model_len, "tokens": ids,
            "token_strs": [text_of(t) for t in ids] if body.return_token_strs else None}


def detokenize(body: DetokenizeBody, backend: Backend) -> dict:
    check_model(body.model or "", backend.model_name)
    bad = next((i for i, t in enumerate(body.tokens) if not 0 <= t < backend.vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(f"tokens[{bad}]", f"token id {body.tokens[bad]} is outside the vocabulary "
                                                    f"[0, {backend.vocab_size})")
    decode = getattr(backend.tokenizer, "decode", None)
    if decode is None:
        raise InvalidRequestError("tokens", "this server's tokenizer does not decode")
    return {"prompt": decode(body.tokens)}
