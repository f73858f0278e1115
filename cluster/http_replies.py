"""The HTTP frontends' replies in OpenAI's shape: errors (``{"error": {message,
type, param, code}}`` with the status of `cluster.errors`' table) and a
request's deltas gathered for a non-streaming answer. `cluster.http_frontend`
and `cluster.http_responses` share them."""
from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from aiohttp import web

from cluster import errors
from cluster import openai_objects as oai_out
from cluster.types import FinishReason, GenerateDelta, GenerateRequest, InvalidRequestError

log = logging.getLogger("cluster.http_frontend")


def error(status: int, message: str, type_: str, param: str | None = None, code: str | None = None,
          headers: dict | None = None) -> web.Response:
    return web.json_response(oai_out.error_body(message, type_, param, code), status=status, headers=headers)


def invalid(e: InvalidRequestError) -> web.Response:
    if e.field == "model":
        return error(404, errors.clip(str(e)), "invalid_request_error", "model", "model_not_found")
    return error(400, errors.clip(str(e)), "invalid_request_error", errors.clip(e.field, 128))


def failure_body(failure: errors.Failure) -> dict:
    return oai_out.error_body(failure.message, failure.code.openai_type, failure.field,
                              failure.openai_code or failure.code.openai_code)


def failed(failure: errors.Failure) -> web.Response:
    """A request refused, or failed inside the cluster, before its response started."""
    if failure.code is errors.Code.INVALID_ARGUMENT:
        return error(400, failure.message, failure.code.openai_type, failure.field)
    headers = {"Retry-After": "1"} if failure.is_retryable else None
    return web.json_response(failure_body(failure), status=failure.code.http_status, headers=headers)


def raised(req: GenerateRequest, e: Exception) -> errors.Failure:
    """The failure an exception from the backend stands for; a failure inside the cluster is logged."""
    failure = errors.classify(e)
    if failure.is_unexpected:
        log.error("request %s failed", req.request_id, exc_info=e)
    return failure


@dataclass
class Whole:
    """A request's deltas gathered for a non-streaming answer."""

    text: str
    logprobs: list
    num_tokens: int
    last: GenerateDelta  # the finishing delta (reason, cached tokens, timeline)


async def gather(req: GenerateRequest, first: GenerateDelta,
                 deltas: AsyncIterator[GenerateDelta]) -> Whole | web.Response:
    """Every delta from ``first`` to the finishing one; a failure on the way as the response to send."""
    parts, lps, num_tokens, delta = [], [], 0, first
    while True:
        if delta.finish_reason is FinishReason.ERROR:
            return failed(errors.request_failed(delta.error))
        parts.append(delta.text)
        lps.extend(delta.logprobs or ())
        num_tokens += len(delta.token_ids)
        if delta.finish_reason is not None:
            return Whole("".join(parts), lps, num_tokens, delta)
        try:
            delta = await anext(deltas)
        except Exception as e:
            return failed(raised(req, e))
