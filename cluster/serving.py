"""What the gRPC and the OpenAI HTTP frontends share.

- `ApiKeys`: the ``Authorization: Bearer <key>`` check.
- `encode_text`, `encode_chat`: a prompt to token ids (a chat through the
  model's chat template, then encoded without special tokens: the template
  holds any BOS).
- `run_request`: a validated request through the backend, with the abort on
  any early exit and the frontend-side metrics, in one place.

Validation itself is `cluster.validation`.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from collections.abc import AsyncIterator, Iterable

from cluster.backend import Backend, Tokenizer
from cluster.errors import quote
from cluster.metrics import RequestMetrics
from cluster.types import (FinishReason, GenerateDelta, GenerateRequest, InvalidRequestError, NoReplicaError,
                           OverloadedError)
from engine.sampling import bad_words_token_ids

log = logging.getLogger(__name__)

INCOMPLETE_STREAM = "the backend ended the stream without finishing the request"
MAX_BAD_WORDS = 128  # words a request may ban (each is tokenized twice: with and without a space before)


class ApiKeys:
    """The configured API keys; none means every client is accepted."""

    def __init__(self, keys: Iterable[str] = ()):
        self._keys = tuple(k.encode() for k in keys)

    def __bool__(self) -> bool:
        return bool(self._keys)

    def check(self, authorization: str | None) -> str | None:
        """None if the ``authorization`` header value carries a valid key (or no keys are set); else why not."""
        if not self._keys:
            return None
        scheme, _, key = (authorization or "").partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            return "missing API key: send 'authorization: Bearer <key>'"
        # Compare against every key so the time taken says nothing about which matched.
        matches = [hmac.compare_digest(key.encode(), k) for k in self._keys]
        return None if any(matches) else "invalid API key"


def encode_text(tokenizer: Tokenizer, text: str, field: str = "prompt") -> list[int]:
    if not text:
        raise InvalidRequestError(field, "must not be empty")
    return list(tokenizer.encode(text))


def encode_bad_words(tokenizer: Tokenizer, words) -> tuple[tuple[int, ...], ...]:
    """vLLM's ``bad_words`` as the token sequences the replicas ban (`engine.sampling.bad_words_token_ids`:
    each word as it is and after a space)."""
    if words is None:
        return ()
    if not isinstance(words, list) or any(not isinstance(w, str) or not w.strip() for w in words):
        raise InvalidRequestError("bad_words", f"must be a list of non-empty strings, got {quote(words)}")
    if len(words) > MAX_BAD_WORDS:
        raise InvalidRequestError("bad_words", f"at most {MAX_BAD_WORDS} words, got {len(words)}")
    ids = bad_words_token_ids(lambda text: tokenizer.encode(text, add_special_tokens=False), words)
    return tuple(tuple(w) for w in ids)


def encode_chat(tokenizer: Tokenizer, messages: list[dict[str, str]], field: str = "messages",
                tools: list[dict] | None = None) -> list[int]:
    """``[{"role": ..., "content": ...}, ...]`` through the chat template (which gets ``tools``
    when given: OpenAI's function definitions), then to token ids."""
    if not messages:
        raise InvalidRequestError(field, "must hold at least one message")
    if any(not m["role"] for m in messages):
        raise InvalidRequestError(field, "every message needs a role")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                         **({"tools": tools} if tools else {}))
    return list(tokenizer.encode(text, add_special_tokens=False))


async def run_request(backend: Backend, request: GenerateRequest,
                      metrics: RequestMetrics) -> AsyncIterator[GenerateDelta]:
    """The backend's deltas for ``request``, up to and including the last (the one with a finish reason).

    Contract for the caller (a frontend), which must close this generator
    (``contextlib.aclosing``):
    - Raises what ``backend.generate`` raises (`OverloadedError`,
      `NoReplicaError`, a failure of the cluster) for the frontend to map.
    - A failure after the start is a last delta with ``FinishReason.ERROR``
      and ``error`` set; a stream that ends unfinished becomes one too.
    - If the request did not finish (the caller stopped early, was
      cancelled, or it failed), it is aborted in the backend.
    - Every delta and the outcome are recorded in ``metrics``.
    """
    outcome = "abort"  # unless it finishes or fails: the caller stopped, i.e. the client went away
    is_finished = False
    try:
        async with contextlib.aclosing(backend.generate(request)) as deltas:
            async for delta in deltas:
                metrics.on_delta(delta)
                if delta.finish_reason is not None:
                    outcome = delta.finish_reason.value
                    is_finished = delta.finish_reason is not FinishReason.ERROR
                    yield delta
                    return
                yield delta
        outcome = FinishReason.ERROR.value
        yield GenerateDelta(request.request_id, finish_reason=FinishReason.ERROR, error=INCOMPLETE_STREAM)
    except OverloadedError:
        outcome = "overloaded"
        raise
    except NoReplicaError:
        outcome = "no_replica"
        raise
    except InvalidRequestError:
        outcome = "invalid_request"
        raise
    except Exception:
        outcome = FinishReason.ERROR.value
        raise
    finally:
        if not is_finished:
            await asyncio.shield(_abort(backend, request.request_id))
        metrics.finish(outcome)


async def _abort(backend: Backend, request_id: str) -> None:
    try:
        await backend.abort(request_id)
    except Exception:
        log.exception("abort of request %s failed", request_id)
