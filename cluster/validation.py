"""Request validation shared by the frontends (gRPC and OpenAI HTTP).

Every check raises `InvalidRequestError` whose message names the field:
``max_tokens: must be >= 1``; a value it quotes is shortened
(`cluster.errors.quote`), so the message stays short whatever was sent.
Unset values (None) take the defaults of
`SamplingParams`, except ``max_tokens``, which defaults to the rest of the
context. ``top_k`` of 0 or -1 disables top-k (OpenAI clients send 0, vLLM
clients -1); other negative values are errors.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

from cluster.errors import quote
from cluster.types import InvalidRequestError, SamplingParams
from engine.guided import GuidedError, GuidedSpec, check_spec
from engine.sampling import MAX_LOGPROBS

MAX_STOP_STRINGS = 16
MAX_REQUEST_ID_LEN = 128
MAX_LOGIT_BIAS = 300  # tokens, as OpenAI allows


def check_model(requested: str, served: str) -> None:
    if requested and requested != served:
        raise InvalidRequestError("model", f"unknown model {quote(requested)}; this server serves {served!r}")


def truncate_prompt(token_ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """vLLM's truncate_prompt_tokens: the prompt's last ``keep`` tokens (-1: as many as leave a token to
    generate in the context); None: the prompt as it is."""
    if keep is None:
        return token_ids
    if keep == -1:
        keep = max_model_len - 1
    if keep < 1:
        raise InvalidRequestError("truncate_prompt_tokens", f"must be >= 1, or -1 for the context's length, "
                                                            f"got {quote(keep)}")
    return token_ids[-keep:]


def _check_ids(field: str, token_ids: Sequence[int], vocab_size: int) -> None:
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(field, f"token id {quote(bad)} is outside the vocabulary [0, {vocab_size})")


def check_request_id(request_id: str) -> None:
    if len(request_id) > MAX_REQUEST_ID_LEN or not request_id.isprintable():
        raise InvalidRequestError("request_id", f"must be at most {MAX_REQUEST_ID_LEN} printable characters")


def validate_request(
    prompt_token_ids: Sequence[int],
    *,
    max_model_len: int,
    vocab_size: int,
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    seed: int | None = None,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    ignore_eos: bool = False,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    guided: GuidedSpec | None = None,
    guided_field: str = "guided",
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    repetition_penalty: float | None = None,
    logit_bias: dict[int, float] | None = None,
    min_tokens: int | None = None,
    include_stop_str_in_output: bool = False,
    skip_special_tokens: bool = True,
    allowed_token_ids: Sequence[int] | None = None,
    bad_words_token_ids: Sequence[Sequence[int]] = (),
) -> SamplingParams:
    """Check a tokenized prompt and its sampling parameters; return the params to run with."""
    n = len(prompt_token_ids)
    if n == 0:
        raise InvalidRequestError("prompt", "must not be empty")
    _check_ids("prompt", prompt_token_ids, vocab_size)
    if n >= max_model_len:
        raise InvalidRequestError("prompt", f"{n} tokens leave no room to generate in the model's "
                                            f"context of {max_model_len} tokens")
    room = max_model_len - n
    if max_tokens is None:
        max_tokens = room
    elif max_tokens < 1:
        raise InvalidRequestError("max_tokens", f"must be >= 1, got {quote(max_tokens)}")
    elif max_tokens > room:
        raise InvalidRequestError("max_tokens", f"{quote(max_tokens)} plus the prompt's {n} tokens exceed the "
                                                f"model's context of {max_model_len} tokens (at most {room})")
    d = SamplingParams()
    temperature = d.temperature if temperature is None else temperature
    if not (math.isfinite(temperature) and temperature >= 0):
        raise InvalidRequestError("temperature", f"must be >= 0, got {quote(temperature)}")
    top_p = d.top_p if top_p is None else top_p
    if not 0 < top_p <= 1:
        raise InvalidRequestError("top_p", f"must be in (0, 1], got {quote(top_p)}")
    top_k = d.top_k if top_k is None else top_k
    if top_k < -1:
        raise InvalidRequestError("top_k", f"must be >= 1, or 0 or -1 to disable, got {quote(top_k)}")
    min_p = d.min_p if min_p is None else min_p
    if not 0 <= min_p <= 1:
        raise InvalidRequestError("min_p", f"must be in [0, 1], got {quote(min_p)}")
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidRequestError("stop", f"at most {MAX_STOP_STRINGS} strings, got {len(stop)}")
    if any(not s for s in stop):
        raise InvalidRequestError("stop", "strings must not be empty")
    _check_ids("stop_token_ids", stop_token_ids, vocab_size)
    for name, value in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
        if value is not None and not 0 <= value <= MAX_LOGPROBS:
            raise InvalidRequestError(name, f"must be in [0, {MAX_LOGPROBS}], got {quote(value)}")
    min_tokens = 0 if min_tokens is None else min_tokens
    if not 0 <= min_tokens <= max_tokens:
        raise InvalidRequestError("min_tokens", f"must be in [0, max_tokens={max_tokens}], got {quote(min_tokens)}")
    if allowed_token_ids is not None:
        if not allowed_token_ids:
            raise InvalidRequestError("allowed_token_ids", "must not be empty")
        _check_ids("allowed_token_ids", allowed_token_ids, vocab_size)
    for ids in bad_words_token_ids:  # (a tokenizer whose ids pass the model's vocabulary)
        _check_ids("bad_words", ids, vocab_size)
    if guided is not None:
        for name, value in (("min_tokens", min_tokens), ("allowed_token_ids", allowed_token_ids)):
            if value:  # the grammar decides which tokens may come and where the output ends
                raise InvalidRequestError(name, f"cannot be combined with {guided_field}")
        try:
            check_spec(guided)  # the grammar engine parses it; the replicas compile it against the vocabulary
        except GuidedError as e:
            raise InvalidRequestError(guided_field, str(e)) from None
    for name, value in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
        if value is not None and not (math.isfinite(value) and -2 <= value <= 2):
            raise InvalidRequestError(name, f"must be in [-2, 2], got {quote(value)}")
    if repetition_penalty is not None and not (math.isfinite(repetition_penalty) and repetition_penalty > 0):
        raise InvalidRequestError("repetition_penalty", f"must be > 0, got {quote(repetition_penalty)}")
    logit_bias = logit_bias or {}
    if len(logit_bias) > MAX_LOGIT_BIAS:
        raise InvalidRequestError("logit_bias", f"at most {MAX_LOGIT_BIAS} tokens, got {len(logit_bias)}")
    for token_id, bias in logit_bias.items():
        if not 0 <= token_id < vocab_size:
            raise InvalidRequestError("logit_bias", f"token id {quote(token_id)} is outside the vocabulary "
                                                    f"[0, {vocab_size})")
        if not (math.isfinite(bias) and -100 <= bias <= 100):
            raise InvalidRequestError("logit_bias", f"bias of token {token_id} must be in [-100, 100], "
                                                    f"got {quote(bias)}")
    return SamplingParams(
        max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=-1 if top_k == 0 else top_k,
        min_p=min_p, seed=seed, stop=tuple(stop), stop_token_ids=tuple(stop_token_ids),
        ignore_eos=ignore_eos, logprobs=logprobs, prompt_logprobs=prompt_logprobs, guided=guided,
        presence_penalty=presence_penalty or 0.0, frequency_penalty=frequency_penalty or 0.0,
        repetition_penalty=1.0 if repetition_penalty is None else repetition_penalty,
        logit_bias=tuple(sorted((int(t), float(b)) for t, b in logit_bias.items())),
        min_tokens=min_tokens, include_stop_str_in_output=include_stop_str_in_output,
        skip_special_tokens=skip_special_tokens,
        allowed_token_ids=None if allowed_token_ids is None else tuple(sorted(set(allowed_token_ids))),
        bad_words_token_ids=tuple(tuple(w) for w in bad_words_token_ids),
    )
