"""The OpenAI-compatible HTTP frontend (aiohttp), beside the gRPC one.

Endpoints:

    POST /v1/completions        prompt: a string, token ids, or a list of either (a choice each)
    POST /v1/chat/completions   messages through the model's chat template, with tools (cluster.tools)
    GET  /v1/models, /v1/models/{id}
    POST /v1/responses          OpenAI's Responses API, text and function calls (`cluster.http_responses`)
    POST /tokenize, /detokenize as vLLM serves them (`cluster.openai_tokenize`)
    GET  /health                200 when every stage has a live replica, else 503 (no key needed;
                                the same rule as gRPC health, `cluster.health`)
    GET  /metrics               Prometheus text (no key needed)

Both completion endpoints take structured output (response_format, vLLM's
guided_* and structured_outputs: `cluster.structured`).

A completion: authenticate (``Authorization: Bearer <key>`` when keys are
configured) → parse the body (`cluster.openai_protocol`) → tokenize and
validate (shared with gRPC) → run it (`cluster.serving.run_request`, which
aborts on any early exit and records the metrics) → one JSON object, or
server-sent events ``data: {...}`` ending ``data: [DONE]`` (`cluster.openai_objects`). A streaming
response starts only once the first delta is in, so a refusal still gets
its status code. Errors use OpenAI's shape ``{"error": {message, type,
param, code}}``:

    400 bad input (param names the field)   401 missing or wrong key
    404 unknown model or path               429 over capacity (OverloadedError)
    503 no replica can serve (NoReplicaError), or the request failed inside
        the cluster; after a stream has started, a ``data: {"error": ...}``
        event instead
    504 a deadline passed
    500 a bug in this frontend, never a failure of the cluster

the same table as gRPC's (`cluster.errors`).

An extension: ``"kvrelay_timeline": true`` in a completion body adds
``"kvrelay_timeline": {"routed_s": ..., "prefill_start_s": ..., ...}`` to the
response (streamed: to the chunk with the finish reason), the request's
phases in seconds after it arrived (`cluster.types.RequestTimeline`; wall
clocks per process, so across hosts it is off by their clocks' difference).

If the client disconnects, the handler is cancelled (or its next write
fails) and the request is aborted in the backend.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import ssl
import time
import uuid
from collections.abc import AsyncIterator

from aiohttp import web

from cluster import errors
from cluster import health as health_check
from cluster import http_responses
from cluster import openai_objects as oai_out
from cluster import openai_protocol as oai
from cluster import openai_tokenize as tok
from cluster.backend import Backend
from cluster.http_replies import error, failed, failure_body, gather, invalid, raised
from cluster.metrics import CONTENT_TYPE, ServingMetrics
from cluster.serving import INCOMPLETE_STREAM, ApiKeys, run_request
from cluster.configs import FrontendConfig
from cluster.types import FinishReason, GenerateDelta, GenerateRequest, InvalidRequestError

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 32 << 20  # a long prompt sent as token ids
STATUS_TIMEOUT_S = health_check.STATUS_TIMEOUT_S  # /health and /metrics wait this long for backend.status()


def _with_timeline(body: dict, req: GenerateRequest, delta: GenerateDelta) -> dict:
    if req.timeline and delta.finish_reason is not None and delta.timeline is not None:
        body["kvrelay_timeline"] = delta.timeline.phases()
    return body


@web.middleware
async def _json_errors(request: web.Request, handler) -> web.StreamResponse:
    """aiohttp's own errors (unknown path, wrong method, body too large) and bugs in OpenAI's shape."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return error(e.status, e.reason, "invalid_request_error" if e.status < 500 else "server_error")
    except Exception as e:  # a bug here: the client gets a 500 in OpenAI's shape, the log the trace
        log.exception("%s %s failed", request.method, request.path)
        return error(500, f"internal error: {type(e).__name__}", "server_error")


class HttpFrontend:
    def __init__(self, backend: Backend, config: FrontendConfig, metrics: ServingMetrics | None = None):
        self.backend = backend
        self.config = config
        self.metrics = metrics if metrics is not None else ServingMetrics(backend.model_name)
        self._api_keys = ApiKeys(config.api_keys)
        self._created = int(time.time())
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        self._running: set[asyncio.Task] = set()  # handlers of generation requests
        self.port: int | None = None

    def make_app(self) -> web.Application:
        app = web.Application(middlewares=[_json_errors], client_max_size=MAX_BODY_BYTES)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/responses", self.responses)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model}", self.model)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.scrape)
        return app

    async def start(self) -> int:
        """Bind and start serving; returns the bound port (useful with http_port 0)."""
        c = self.config
        # handler_cancellation: a client that disconnects cancels its handler, which aborts the request.
        # Handlers still running when `stop`'s grace is over are cancelled almost at once (aiohttp reads a
        # shutdown_timeout of 0 as "no limit").
        runner = web.AppRunner(self.make_app(), handler_cancellation=True, access_log=None, shutdown_timeout=0.05)
        await runner.setup()
        ssl_context = None
        if c.tls_cert_file:
            ssl_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            ssl_context.load_cert_chain(c.tls_cert_file, c.tls_key_file)
        site = web.TCPSite(runner, c.host, c.http_port or 0, ssl_context=ssl_context, reuse_port=c.reuse_port or None)
        try:
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner, self._site = runner, site
        self.port = runner.addresses[0][1]
        log.info("kvrelay OpenAI HTTP frontend on %s:%d", c.host, self.port)
        return self.port

    async def stop(self, grace: float | None = 5.0) -> None:
        """Stop accepting, give running requests ``grace`` seconds, then cancel them (which aborts them)."""
        if self._runner is None:
            return
        runner, self._runner = self._runner, None
        await self._site.stop()
        if self._running and grace:
            await asyncio.wait(set(self._running), timeout=grace)
        await runner.cleanup()

    # ---- generation ------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, oai_out.CompletionResponses)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, oai_out.ChatResponses)

    async def responses(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, None)

    async def _generate(self, request: web.Request, responses: type[oai_out.CompletionOrChatResponses] | None
                        ) -> web.StreamResponse:
        """``responses`` None: the Responses API's objects."""
        task = asyncio.current_task()
        self._running.add(task)
        try:
            if responses is None:
                return await self._run_response(request)
            return await self._run(request, responses)
        finally:
            self._running.discard(task)

    async def _run(self, request: web.Request, responses: type[oai_out.CompletionOrChatResponses]
                   ) -> web.StreamResponse:
        if (problem := self._api_keys.check(request.headers.get("Authorization"))) is not None:
            self.metrics.count_rejected("http", "unauthenticated")
            return error(401, problem, "authentication_error", code="invalid_api_key")
        response_id = responses.id_prefix + uuid.uuid4().hex
        try:
            body = oai.parse_body(responses.body_type, await request.read())
            tools = (oai.chat_tools(body, self.backend, self.config.tool_call_format)
                     if isinstance(body, oai.ChatBody) else None)
            choices = oai.to_choices(body, self.backend, response_id, tools)
        except InvalidRequestError as e:
            self.metrics.count_rejected("http", "invalid_request")
            return invalid(e)
        if len(choices) > 1 or choices[0].echo_text:
            return await self._run_choices(request, responses, body, response_id, choices, tools)
        req = choices[0].request
        out = responses(req.request_id, self.backend.model_name, oai_out.token_text(self.backend.tokenizer),
                        with_logprobs=req.sampling.logprobs is not None, include_usage=body.include_usage,
                        with_prompt_logprobs=body.prompt_logprobs is not None,
                        **({"tools": tools} if tools is not None else {}))
        running = run_request(self.backend, req, self.metrics.start_request("http", req))
        async with contextlib.aclosing(running) as deltas:
            try:
                first = await anext(deltas)
            except InvalidRequestError as e:
                return invalid(e)
            except Exception as e:  # the backend's refusals, and failures inside the cluster
                return failed(raised(req, e))
            if first.finish_reason is FinishReason.ERROR:
                return failed(errors.request_failed(first.error))
            out.set_prompt(req.prompt_token_ids, first.prompt_logprobs)
            if body.stream:
                return await self._stream(request, req, out, first, deltas)
            return await self._collect(req, out, first, deltas)

    @staticmethod
    async def _collect(req: GenerateRequest, out: oai_out.CompletionOrChatResponses,
                       first: GenerateDelta, deltas: AsyncIterator[GenerateDelta]) -> web.Response:
        whole = await gather(req, first, deltas)
        if isinstance(whole, web.Response):
            return whole
        delta = whole.last
        usage = oai_out.usage(req.num_prompt_tokens, whole.num_tokens, delta.num_cached_tokens)
        return web.json_response(_with_timeline(out.response(whole.text, delta.finish_reason, whole.logprobs,
                                                             usage), req, delta))

    @staticmethod
    async def _stream(request: web.Request, req: GenerateRequest, out: oai_out.CompletionOrChatResponses,
                      first: GenerateDelta, deltas: AsyncIterator[GenerateDelta]) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)

        async def send(data: dict | str) -> None:
            text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
            await response.write(f"data: {text}\n\n".encode())

        num_tokens, delta, is_first = 0, first, True
        try:
            while True:
                if delta.finish_reason is FinishReason.ERROR:
                    await send(failure_body(errors.request_failed(delta.error)))
                    break
                num_tokens += len(delta.token_ids)
                if delta.text or delta.logprobs or delta.finish_reason is not None or is_first:
                    await send(_with_timeline(out.chunk(delta.text, delta.finish_reason, delta.logprobs or ()),
                                              req, delta))
                    is_first = False
                if delta.finish_reason is not None:
                    if out.include_usage:
                        await send(out.usage_chunk(oai_out.usage(req.num_prompt_tokens, num_tokens,
                                                             delta.num_cached_tokens)))
                    break
                try:
                    delta = await anext(deltas)
                except Exception as e:
                    await send(failure_body(raised(req, e)))
                    break
            await send("[DONE]")
            await response.write_eof()
        except ConnectionError:  # the client went away; leaving aclosing aborts the request
            log.info("client of request %s disconnected", req.request_id)
        return response

    # ---- several choices (a list of prompts, n > 1) or echo -------------------------
    async def _run_choices(self, request: web.Request, responses: type[oai_out.CompletionOrChatResponses],
                           body, response_id: str, choices: list[oai.Choice], tools=None) -> web.StreamResponse:
        """Every choice runs as its own request, all at once; the response starts once each has its first
        delta (a refusal of any is the response's status), and a failure of any fails the response."""
        text_of = oai_out.token_text(self.backend.tokenizer)
        outs = [responses(response_id, self.backend.model_name, text_of,
                          with_logprobs=c.request.sampling.logprobs is not None, include_usage=body.include_usage,
                          index=c.index, echo_logprobs=oai.echo_logprobs(body),
                          with_prompt_logprobs=body.prompt_logprobs is not None,
                          **({"tools": tools} if tools is not None else {})) for c in choices]
        async with contextlib.AsyncExitStack() as stack:
            streams = [await stack.enter_async_context(contextlib.aclosing(
                run_request(self.backend, c.request, self.metrics.start_request("http", c.request))))
                for c in choices]
            reading = _ChoiceStreams(streams)
            stack.push_async_callback(reading.aclose)  # (runs first: the readers stop before the streams close)
            firsts = await reading.firsts()
            for c, first in zip(choices, firsts):
                if isinstance(first, InvalidRequestError):
                    return invalid(first)
                if isinstance(first, BaseException):
                    return failed(raised(c.request, first))
                if first.finish_reason is FinishReason.ERROR:
                    return failed(errors.request_failed(first.error))
            # a prompt's choice 0 (not a fork) scored it for the prompt's every choice
            scored = {c.prompt_index: first.prompt_logprobs for c, first in zip(choices, firsts)
                      if c.request.fork_of is None}
            for c, out in zip(choices, outs):
                out.set_prompt(c.request.prompt_token_ids, scored.get(c.prompt_index))
            deltas = reading.merged()
            try:
                if body.stream:
                    return await _stream_choices(request, choices, outs, deltas)
                return await _collect_choices(choices, outs, deltas)
            finally:
                await deltas.aclose()

    # ---- the Responses API ------------------------------------------------------------
    async def _run_response(self, request: web.Request) -> web.StreamResponse:
        return await http_responses.run_response(self, request)

    # ---- the rest --------------------------------------------------------------
    async def models(self, request: web.Request) -> web.Response:
        if (problem := self._api_keys.check(request.headers.get("Authorization"))) is not None:
            return error(401, problem, "authentication_error", code="invalid_api_key")
        b = self.backend
        return web.json_response(oai_out.model_list(b.model_name, b.max_model_len, self._created,
                                                  getattr(b, "tokenizer_dir", None)))

    async def model(self, request: web.Request) -> web.Response:
        if (problem := self._api_keys.check(request.headers.get("Authorization"))) is not None:
            return error(401, problem, "authentication_error", code="invalid_api_key")
        b = self.backend
        if request.match_info["model"] != b.model_name:
            return error(404, f"model: unknown model {errors.quote(request.match_info['model'])}; this server "
                               f"serves {b.model_name!r}", "invalid_request_error", "model", "model_not_found")
        return web.json_response(oai_out.model_card(b.model_name, b.max_model_len, self._created,
                                                  getattr(b, "tokenizer_dir", None)))

    async def tokenize(self, request: web.Request) -> web.Response:
        return await self._tokenization(request, tok.TokenizeBody, tok.tokenize)

    async def detokenize(self, request: web.Request) -> web.Response:
        return await self._tokenization(request, tok.DetokenizeBody, tok.detokenize)

    async def _tokenization(self, request: web.Request, body_type, handle) -> web.Response:
        if (problem := self._api_keys.check(request.headers.get("Authorization"))) is not None:
            return error(401, problem, "authentication_error", code="invalid_api_key")
        try:
            return web.json_response(handle(oai.parse_body(body_type, await request.read()), self.backend))
        except InvalidRequestError as e:
            return invalid(e)

    async def health(self, request: web.Request) -> web.Response:
        reason = await health_check.check(self.backend, STATUS_TIMEOUT_S)
        if reason is not None:
            return web.json_response({"status": "unavailable", "reason": errors.clip(reason)}, status=503)
        return web.json_response({"status": "ok"})

    async def scrape(self, request: web.Request) -> web.Response:
        await self.metrics.refresh(self.backend, STATUS_TIMEOUT_S)
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})


class _ChoiceStreams:
    """Every choice's stream read from the start, each by a task of its own, into one queue: a choice
    holds its router placement until its stream is read to its end, so a choice still waiting for a
    replica must never wait on how far the response has read another choice (a list of more prompts
    than the replicas hold at once would wait for ever). `firsts` gives each choice's first delta (or
    the exception its stream raised before one); `merged` gives those, then the rest as they come."""

    def __init__(self, streams: list[AsyncIterator[GenerateDelta]]):
        self._queue: asyncio.Queue = asyncio.Queue()
        self._later: list[tuple[int, GenerateDelta | BaseException | None]] = []  # came before every first did
        self._readers = [asyncio.create_task(self._read(i, s)) for i, s in enumerate(streams)]
        self._firsts: list = [None] * len(streams)

    async def _read(self, i: int, stream: AsyncIterator[GenerateDelta]) -> None:
        try:
            async for delta in stream:
                await self._queue.put((i, delta))
        except Exception as e:
            await self._queue.put((i, e))
        finally:
            await self._queue.put((i, None))

    async def firsts(self) -> list[GenerateDelta | BaseException]:
        missing = set(range(len(self._firsts)))
        while missing:
            i, item = await self._queue.get()
            if i not in missing:
                self._later.append((i, item))
                continue
            missing.discard(i)
            self._firsts[i] = item if item is not None else RuntimeError(INCOMPLETE_STREAM)
            if item is None:
                self._later.append((i, None))
        return list(self._firsts)

    async def merged(self) -> AsyncIterator[tuple[int, GenerateDelta | BaseException]]:
        """(choice position, delta or the exception its stream raised), the first deltas first; ends when
        every stream has ended."""
        for i, first in enumerate(self._firsts):
            yield i, first
        num_open = len(self._readers)
        for i, item in self._later:
            if item is None:
                num_open -= 1
            else:
                yield i, item
        while num_open:
            i, item = await self._queue.get()
            if item is None:
                num_open -= 1
                continue
            yield i, item

    async def aclose(self) -> None:
        """Stop the readers (before the streams are closed: their owner then aborts the requests)."""
        for r in self._readers:
            r.cancel()
        await asyncio.gather(*self._readers, return_exceptions=True)


def _choices_usage(choices: list[oai.Choice], num_tokens: list[int], num_cached: list[int]) -> dict:
    """Each prompt counted once, however many choices it has, with the most of its tokens that one of its
    choices reused (choices after the first share the first's prompt blocks); every choice's completion tokens."""
    prompts = {c.prompt_index: c.request for c in choices}
    cached: dict[int, int] = {}
    for c, n in zip(choices, num_cached):
        cached[c.prompt_index] = max(n, cached.get(c.prompt_index, 0))
    return oai_out.usage(sum(r.num_prompt_tokens for r in prompts.values()), sum(num_tokens), sum(cached.values()))


async def _collect_choices(choices: list[oai.Choice], outs: list, deltas) -> web.Response:
    parts: list[list[str]] = [[c.echo_text] for c in choices]
    lps: list[list] = [[] for _ in choices]
    num_tokens, num_cached = [0] * len(choices), [0] * len(choices)
    reasons: list[FinishReason | None] = [None] * len(choices)
    async for i, delta in deltas:
        if isinstance(delta, BaseException):
            return failed(raised(choices[i].request, delta))
        if delta.finish_reason is FinishReason.ERROR:
            return failed(errors.request_failed(delta.error))
        delta = choices[i].visible(delta)
        parts[i].append(delta.text)
        lps[i].extend(delta.logprobs or ())
        num_tokens[i] += len(delta.token_ids)
        if delta.finish_reason is not None:
            reasons[i], num_cached[i] = delta.finish_reason, delta.num_cached_tokens
    if None in reasons:
        return failed(errors.request_failed(INCOMPLETE_STREAM))
    usage = _choices_usage(choices, num_tokens, num_cached)
    objects = [out.response("".join(p), reason, lp, usage) for out, p, reason, lp in zip(outs, parts, reasons, lps)]
    return web.json_response(dict(objects[0], choices=[o["choices"][0] for o in objects]))


async def _stream_choices(request: web.Request, choices: list[oai.Choice], outs: list, deltas) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)

    async def send(data: dict | str) -> None:
        text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
        await response.write(f"data: {text}\n\n".encode())

    num_tokens, num_cached = [0] * len(choices), [0] * len(choices)
    is_first = [True] * len(choices)
    num_finished = 0
    try:
        async for i, delta in deltas:
            if isinstance(delta, BaseException):
                await send(failure_body(raised(choices[i].request, delta)))
                break
            if delta.finish_reason is FinishReason.ERROR:
                await send(failure_body(errors.request_failed(delta.error)))
                break
            delta = choices[i].visible(delta)
            num_tokens[i] += len(delta.token_ids)
            text = (choices[i].echo_text if is_first[i] else "") + delta.text
            if text or delta.logprobs or delta.finish_reason is not None or is_first[i]:
                await send(outs[i].chunk(text, delta.finish_reason, delta.logprobs or ()))
                is_first[i] = False
            if delta.finish_reason is not None:
                num_cached[i] = delta.num_cached_tokens
                num_finished += 1
        if num_finished == len(choices) and outs[0].include_usage:
            await send(outs[0].usage_chunk(_choices_usage(choices, num_tokens, num_cached)))
        await send("[DONE]")
        await response.write_eof()
    except ConnectionError:  # the client went away; closing the streams aborts the requests
        log.info("client of request %s disconnected", outs[0].request_id)
    return response
