"""``POST /v1/responses`` on the HTTP frontend: OpenAI's Responses API,
text and function calls (`cluster.openai_responses` builds the objects and
events), whole or as server-sent events ``event: <type>`` / ``data: {...}``.

authenticate → parse the body, its tools and input items → tokenize and
validate → run it (`cluster.serving.run_request`) → one response object, or
its events. A streaming response starts only once the first delta is in,
so a refusal still gets its status code; a failure after that is an
``error`` event, as OpenAI sends it.
"""
from __future__ import annotations

import contextlib
import json
import logging
import uuid
from collections.abc import AsyncIterator

from aiohttp import web

from cluster import errors
from cluster import openai_protocol as oai
from cluster import openai_responses as rsp
from cluster.http_replies import error, failed, gather, invalid, raised
from cluster.serving import run_request
from cluster.types import FinishReason, GenerateDelta, GenerateRequest, InvalidRequestError

log = logging.getLogger("cluster.http_frontend")


async def run_response(frontend, request: web.Request) -> web.StreamResponse:
    """One request to ``frontend`` (a `cluster.http_frontend.HttpFrontend`)."""
    if (problem := frontend._api_keys.check(request.headers.get("Authorization"))) is not None:
        frontend.metrics.count_rejected("http", "unauthenticated")
        return error(401, problem, "authentication_error", code="invalid_api_key")
    backend = frontend.backend
    try:
        body = oai.parse_body(rsp.ResponsesBody, await request.read())
        tools = rsp.parse_tools(body, backend, frontend.config.tool_call_format)
        req = rsp.to_generate_request(body, backend, "resp_" + uuid.uuid4().hex, tools)
    except InvalidRequestError as e:
        frontend.metrics.count_rejected("http", "invalid_request")
        return invalid(e)
    objects = rsp.ResponseObjects(body, req, backend.model_name, tools)
    running = run_request(backend, req, frontend.metrics.start_request("http", req))
    async with contextlib.aclosing(running) as deltas:
        try:
            first = await anext(deltas)
        except InvalidRequestError as e:
            return invalid(e)
        except Exception as e:
            return failed(raised(req, e))
        if first.finish_reason is FinishReason.ERROR:
            return failed(errors.request_failed(first.error))
        if body.stream:
            return await _stream(request, req, objects, first, deltas)
        whole = await gather(req, first, deltas)
        if isinstance(whole, web.Response):
            return whole
        return web.json_response(objects.response(whole.text, whole.last.finish_reason, whole.num_tokens,
                                                  whole.last.num_cached_tokens))


async def _stream(request: web.Request, req: GenerateRequest, objects: rsp.ResponseObjects,
                  first: GenerateDelta, deltas: AsyncIterator[GenerateDelta]) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)

    async def send(event: dict) -> None:
        await response.write(f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n"
                             .encode())

    async def fail(failure: errors.Failure) -> None:
        await send(objects.event("error", code=failure.openai_code or failure.code.openai_code,
                                 message=failure.message, param=failure.field))

    num_tokens, delta = 0, first
    try:
        for event in objects.opening():
            await send(event)
        while True:
            if delta.finish_reason is FinishReason.ERROR:
                await fail(errors.request_failed(delta.error))
                break
            num_tokens += len(delta.token_ids)
            if delta.text:
                for event in objects.delta(delta.text):
                    await send(event)
            if delta.finish_reason is not None:
                for event in objects.closing(delta.finish_reason, num_tokens, delta.num_cached_tokens):
                    await send(event)
                break
            try:
                delta = await anext(deltas)
            except Exception as e:
                await fail(raised(req, e))
                break
        await response.write_eof()
    except ConnectionError:
        log.info("client of request %s disconnected", req.request_id)
    return response
