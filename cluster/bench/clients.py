"""The benchmark's two ways of sending a request: kvrelay gRPC and OpenAI HTTP.

A sender fills in a `RequestRecord` as the stream arrives (first token,
every gap, token count, outcome) and sets ``end_s`` when the stream ends. The
runner sets ``start_s`` and handles cancellation: a cancelled send leaves
``end_s`` unset and the runner records why.

Token counting:

- gRPC: each message carries its token ids, so counts and gaps are exact
  (a message with k tokens spreads its gap over them, see `stats`).
- OpenAI HTTP (streaming ``/v1/completions``): a server-sent event is not
  guaranteed to hold exactly one token. Each event with non-empty text counts
  as one token arrival (its gap is one ITL entry); when the stream ends with
  ``usage`` (we ask for it with ``stream_options.include_usage``), its
  ``completion_tokens`` replaces the count and ``prompt_tokens`` the prompt
  length. So on HTTP, ITL is per event and TPOT uses the server's count.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import aiohttp

from cluster.bench.stats import RequestRecord
from cluster.bench.workload import RequestSpec
from cluster.client import AsyncKVRelayClient, KVRelayError
from cluster.types import FinishReason
from engine.serving.timeouts import within

Clock = Callable[[], float]


class BenchError(RuntimeError):
    """The benchmark cannot run (server unreachable, bad configuration)."""


@dataclass(frozen=True)
class ServerInfo:
    model: str
    vocab_size: int | None = None  # known over gRPC: random prompts are token ids below it
    max_model_len: int | None = None


class Sender(Protocol):
    async def setup(self) -> ServerInfo: ...

    async def send(self, spec: RequestSpec, rec: RequestRecord, clock: Clock) -> None: ...

    async def close(self) -> None: ...


def add_tokens(rec: RequestRecord, now_s: float, num_tokens: int, last_s: float | None) -> float | None:
    """Record ``num_tokens`` arriving at ``now_s``; returns the new last-arrival time."""
    if num_tokens <= 0:
        return last_s
    if rec.ttft_s is None or last_s is None:
        rec.ttft_s = now_s - rec.start_s
        rec.itls_s.extend([0.0] * (num_tokens - 1))
    else:
        rec.itls_s.extend([(now_s - last_s) / num_tokens] * num_tokens)
    rec.num_output_tokens += num_tokens
    return now_s


def _fail(rec: RequestRecord, code: str, message: str) -> None:
    rec.is_ok, rec.error_code, rec.error_message = False, code, message[:500]


class GrpcSender:
    """Streams ``Generate`` calls over one channel of `AsyncKVRelayClient`."""

    def __init__(self, target: str, *, api_key: str | None = None, tls: bool = False,
                 root_certificates: str | None = None, model: str = "", temperature: float | None = None,
                 ignore_eos: bool = True):
        self.target, self.api_key, self.tls, self.root_certificates = target, api_key, tls, root_certificates
        self.model, self.temperature, self.ignore_eos = model, temperature, ignore_eos
        self.client: AsyncKVRelayClient | None = None

    async def setup(self) -> ServerInfo:
        self.client = AsyncKVRelayClient(self.target, self.api_key, tls=self.tls,
                                         root_certificates=self.root_certificates)
        try:
            models = await within(self.client.list_models(), 30)
        except (KVRelayError, asyncio.TimeoutError) as e:
            raise BenchError(f"cannot list the models of {self.target}: {e or 'timed out'}") from None
        m = next((m for m in models if not self.model or m.id == self.model), None)
        if m is None:
            raise BenchError(f"{self.target} does not serve {self.model!r} (it serves {[m.id for m in models]})")
        return ServerInfo(m.id, m.vocab_size, m.max_model_len)

    async def send(self, spec: RequestSpec, rec: RequestRecord, clock: Clock) -> None:
        prompt = {"prompt": spec.prompt} if isinstance(spec.prompt, str) else {"token_ids": spec.prompt}
        finish, last = None, None
        try:
            async with contextlib.aclosing(self.client.stream(
                    **prompt, model=self.model, max_tokens=spec.output_len, temperature=self.temperature,
                    ignore_eos=self.ignore_eos)) as chunks:
                async for chunk in chunks:
                    last = add_tokens(rec, clock(), len(chunk.token_ids), last)
                    if chunk.usage is not None and chunk.usage.prompt_tokens:
                        rec.prompt_len = chunk.usage.prompt_tokens
                    finish = chunk.finish_reason or finish
        except KVRelayError as e:
            _fail(rec, e.code.name, e.message)
        else:
            if finish is None:
                _fail(rec, "INCOMPLETE", "the stream ended without a finish reason")
            elif finish is FinishReason.ABORT:
                _fail(rec, "ABORTED", "the server aborted the request")
            else:
                rec.is_ok = True
        rec.end_s = clock()

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()


def _error_text(body: str) -> str:
    with contextlib.suppress(ValueError, TypeError, AttributeError):
        err = json.loads(body).get("error")
        return str(err.get("message", err) if isinstance(err, dict) else err)
    return body


class OpenAISender:
    """Streams ``POST {base_url}/completions`` of an OpenAI-compatible server (aiohttp, SSE)."""

    def __init__(self, base_url: str, *, api_key: str | None = None, model: str = "",
                 temperature: float | None = None, ignore_eos: bool = True):
        self.base_url = base_url.rstrip("/")
        self.model, self.temperature, self.ignore_eos = model, temperature, ignore_eos
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.session: aiohttp.ClientSession | None = None

    async def setup(self) -> ServerInfo:
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None),
                                             connector=aiohttp.TCPConnector(limit=0), headers=self.headers)
        if self.model:
            return ServerInfo(self.model)
        try:
            async with self.session.get(f"{self.base_url}/models", timeout=aiohttp.ClientTimeout(total=30)) as r:
                if r.status != 200:
                    raise BenchError(f"GET {self.base_url}/models: HTTP {r.status}: {_error_text(await r.text())}")
                models = (await r.json()).get("data") or []
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise BenchError(f"GET {self.base_url}/models failed: {e or 'timed out'}") from None
        if not models:
            raise BenchError(f"{self.base_url}/models lists no model; pass --model")
        self.model = models[0]["id"]
        return ServerInfo(self.model)

    def _body(self, spec: RequestSpec) -> dict:
        body = {"model": self.model, "prompt": spec.prompt, "max_tokens": spec.output_len, "stream": True,
                "stream_options": {"include_usage": True}}
        if self.ignore_eos:
            body["ignore_eos"] = True  # an extension that vLLM, SGLang and kvrelay accept
        if self.temperature is not None:
            body["temperature"] = self.temperature
        return body

    async def send(self, spec: RequestSpec, rec: RequestRecord, clock: Clock) -> None:
        try:
            async with self.session.post(f"{self.base_url}/completions", json=self._body(spec)) as resp:
                if resp.status != 200:
                    _fail(rec, f"HTTP_{resp.status}", _error_text(await resp.text()))
                else:
                    await self._read_stream(resp, rec, clock)
        except aiohttp.ClientError as e:
            _fail(rec, "CONNECTION_ERROR", f"{type(e).__name__}: {e}")
        rec.end_s = clock()

    async def _read_stream(self, resp: aiohttp.ClientResponse, rec: RequestRecord, clock: Clock) -> None:
        is_done, is_finished, usage, last = False, False, None, None
        async for raw in resp.content:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:"):
                continue  # blank separators, comments (":"), event names
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                is_done = True
                break
            try:
                event = json.loads(data)
            except ValueError:
                return _fail(rec, "BAD_STREAM", f"an event is not JSON: {data[:100]!r}")
            if event.get("error"):
                return _fail(rec, "STREAM_ERROR", _error_text(data))
            now = clock()
            for choice in event.get("choices") or []:
                if choice.get("text"):
                    last = add_tokens(rec, now, 1, last)
                is_finished = is_finished or bool(choice.get("finish_reason"))
            usage = event.get("usage") or usage
        if usage:
            rec.num_output_tokens = usage.get("completion_tokens", rec.num_output_tokens)
            rec.prompt_len = usage.get("prompt_tokens") or rec.prompt_len
        if is_done or is_finished:
            rec.is_ok = True
        else:
            _fail(rec, "INCOMPLETE", "the stream ended without [DONE] or a finish reason")

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
