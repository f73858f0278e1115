"""Python clients for the kvrelay gRPC API.

    client = KVRelayClient("localhost:50051", api_key="...")
    result = client.generate("The capital of France is", max_tokens=8, temperature=0)
    for chunk in client.stream("Tell me a story", max_tokens=64):
        print(chunk.text, end="", flush=True)
    client.chat([{"role": "user", "content": "Hi!"}]).text

`AsyncKVRelayClient` has the same methods as coroutines (``stream`` is an
async iterator). Every failure raises `KVRelayError` with the gRPC code.
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from cluster.types import (ClusterStatus, FinishReason, ProfileTrace, ReplicaStatus, RequestTimeline, Stage,
                           TokenLogprob)
from protos.kvrelay.v1 import serving_pb2 as pb
from protos.kvrelay.v1 import serving_pb2_grpc as pb_grpc

_FINISH = {pb.FINISH_REASON_STOP: FinishReason.STOP, pb.FINISH_REASON_LENGTH: FinishReason.LENGTH,
           pb.FINISH_REASON_ABORT: FinishReason.ABORT}


class KVRelayError(Exception):
    """A call failed. ``code`` is the grpc.StatusCode, ``message`` the server's details."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message

    @classmethod
    def from_rpc_error(cls, err: grpc.RpcError) -> "KVRelayError":
        return cls(err.code(), err.details() or "")


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0


@dataclass
class Chunk:
    """One streamed message: new text and tokens since the previous one."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    usage: Usage | None = None  # on the last chunk
    logprobs: list[TokenLogprob] = field(default_factory=list)
    timeline: RequestTimeline | None = None  # on the last chunk, when asked for (timeline=True)
    # on the first chunk, when asked for (prompt_logprobs=k): one per prompt token after the first
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass
class Completion:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None
    usage: Usage
    logprobs: list[TokenLogprob] = field(default_factory=list)
    timeline: RequestTimeline | None = None  # when asked for (timeline=True)
    # when asked for (prompt_logprobs=k): each prompt token's but the first
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass(frozen=True)
class ModelInfo:
    id: str
    max_model_len: int
    vocab_size: int
    tokenizer_dir: str = ""  # the served checkpoint's folder (tokenizer included) on the frontend's host


def build_request(prompt: str | None = None, *, messages: Sequence[dict[str, str]] | None = None,
                  token_ids: Sequence[int] | None = None, model: str = "", request_id: str = "",
                  max_tokens: int | None = None, temperature: float | None = None, top_p: float | None = None,
                  top_k: int | None = None, min_p: float | None = None, seed: int | None = None,
                  stop: Sequence[str] = (), stop_token_ids: Sequence[int] = (), ignore_eos: bool = False,
                  logprobs: int | None = None, presence_penalty: float | None = None,
                  frequency_penalty: float | None = None, repetition_penalty: float | None = None,
                  logit_bias: dict[int, float] | None = None, timeline: bool = False,
                  guided: dict | None = None, prompt_logprobs: int | None = None, min_tokens: int | None = None,
                  include_stop_str_in_output: bool = False, skip_special_tokens: bool | None = None,
                  allowed_token_ids: Sequence[int] = (), truncate_prompt_tokens: int | None = None,
                  bad_words: Sequence[str] = ()) -> pb.GenerateRequest:
    """Exactly one of ``prompt``, ``messages``, ``token_ids``; unset sampling fields take server defaults.
    ``timeline``: ask for the request's `RequestTimeline` on the last chunk. ``prompt_logprobs``: the
    prompt's tokens' logprobs and ranks (with that many alternatives), on the first chunk. ``min_tokens``,
    ``include_stop_str_in_output``, ``skip_special_tokens``, ``allowed_token_ids``, ``bad_words``: as
    vLLM's (`engine.sampling.SamplingParams`); ``truncate_prompt_tokens``: keep the prompt's last that many
    tokens (-1: as many as fit the context with one to generate), as vLLM's. ``guided``: structured
    output, one of ``{"json_schema": {...}}``, ``{"json_object": True}``, ``{"regex": "..."}``,
    ``{"choice": ["a", "b"]}``, ``{"grammar": "root ::= ..."}``."""
    given = [name for name, v in (("prompt", prompt), ("messages", messages), ("token_ids", token_ids)) if v is not None]
    if len(given) != 1:
        raise ValueError(f"give exactly one of prompt, messages, token_ids (got {given or 'none'})")
    optional = {"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p, "top_k": top_k,
                "min_p": min_p, "seed": seed, "logprobs": logprobs, "presence_penalty": presence_penalty,
                "frequency_penalty": frequency_penalty, "repetition_penalty": repetition_penalty,
                "prompt_logprobs": prompt_logprobs, "min_tokens": min_tokens,
                "skip_special_tokens": skip_special_tokens, "truncate_prompt_tokens": truncate_prompt_tokens}
    sampling = pb.SamplingParams(stop=list(stop), stop_token_ids=list(stop_token_ids), ignore_eos=ignore_eos,
                                 logit_bias=dict(logit_bias or {}), allowed_token_ids=list(allowed_token_ids),
                                 bad_words=list(bad_words),
                                 include_stop_str_in_output=include_stop_str_in_output,
                                 **{k: v for k, v in optional.items() if v is not None})
    req = pb.GenerateRequest(model=model, request_id=request_id, sampling=sampling, timeline=timeline)
    if guided is not None:
        req.guided.CopyFrom(_guided(guided))
    if prompt is not None:
        req.text = prompt
    elif messages is not None:
        req.chat.CopyFrom(pb.ChatMessages(messages=[pb.ChatMessage(role=m["role"], content=m["content"])
                                                    for m in messages]))
        if not messages:  # an empty oneof member must still be selected
            req.chat.SetInParent()
    else:
        req.token_ids.CopyFrom(pb.TokenIds(ids=list(token_ids)))
        if not token_ids:
            req.token_ids.SetInParent()
    return req


def _guided(guided: dict) -> pb.GuidedDecoding:
    if len(guided) != 1:
        raise ValueError(f"guided: give one constraint, got {sorted(guided)}")
    (kind, value), = guided.items()
    if kind == "json_schema":
        return pb.GuidedDecoding(json_schema=value if isinstance(value, str) else json.dumps(value))
    if kind == "choice":
        return pb.GuidedDecoding(choice=pb.ChoiceList(choices=list(value)))
    if kind in ("json_object", "regex", "grammar"):
        return pb.GuidedDecoding(**{kind: value})
    raise ValueError(f"guided: unknown constraint {kind!r}")


def _chunk(resp: pb.GenerateResponse) -> Chunk:
    usage = None
    if resp.HasField("usage"):
        u = resp.usage
        usage = Usage(u.prompt_tokens, u.completion_tokens, u.cached_prompt_tokens)
    timeline = None
    if resp.HasField("timeline"):
        t = resp.timeline
        timeline = RequestTimeline(**{k: getattr(t, k) for k in RequestTimeline.PHASES if t.HasField(k)})
    return Chunk(resp.request_id, resp.text, list(resp.token_ids), _FINISH.get(resp.finish_reason), usage,
                 [_logprob(lp) for lp in resp.logprobs], timeline, [_logprob(lp) for lp in resp.prompt_logprobs])


def _logprob(lp: pb.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(lp.token_id, lp.logprob, tuple((t.token_id, t.logprob) for t in lp.top),
                        lp.rank if lp.HasField("rank") else None)


class _Collector:
    def __init__(self):
        self.request_id, self.text, self.token_ids, self.logprobs, self.prompt_logprobs = "", [], [], [], []
        self.finish_reason, self.usage, self.timeline = None, Usage(), None

    def add(self, c: Chunk) -> None:
        self.request_id = c.request_id
        self.text.append(c.text)
        self.token_ids.extend(c.token_ids)
        self.logprobs.extend(c.logprobs)
        self.prompt_logprobs.extend(c.prompt_logprobs)
        if c.finish_reason is not None:
            self.finish_reason = c.finish_reason
        if c.usage is not None:
            self.usage = c.usage
        if c.timeline is not None:
            self.timeline = c.timeline

    def result(self) -> Completion:
        return Completion(self.request_id, "".join(self.text), self.token_ids, self.finish_reason, self.usage,
                          self.logprobs, self.timeline, self.prompt_logprobs)


def _status(resp: pb.GetStatusResponse) -> ClusterStatus:
    return ClusterStatus(resp.model, resp.mode, tuple(
        ReplicaStatus(r.replica_id, Stage(r.stage), r.alive, r.running_seqs, r.queued_prefill_tokens,
                      r.in_flight, r.free_blocks, r.total_blocks, r.state or "serving", r.restarts, r.last_error,
                      r.tensor_parallel_size or 1, tuple(r.rank_pids), quantization=r.quantization,
                      kernel_isa=r.kernel_isa, pipeline_parallel_size=r.pipeline_parallel_size or 1)
        for r in resp.replicas), resp.waiting)


def _traces(resp: pb.ProfileResponse) -> list[ProfileTrace]:
    if resp.traces:
        return [ProfileTrace(t.replica_id, t.host, t.path) for t in resp.traces]
    return [ProfileTrace("", "", p) for p in resp.trace_files]


def _credentials(root_certificates: str | Path | None) -> grpc.ChannelCredentials:
    roots = Path(root_certificates).read_bytes() if root_certificates else None
    return grpc.ssl_channel_credentials(root_certificates=roots)


class _Base:
    def __init__(self, api_key: str | None, timeout: float | None):
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self.timeout = timeout


class KVRelayClient(_Base):
    """Blocking client. ``tls=True`` (or ``root_certificates``) for a TLS server."""

    def __init__(self, target: str, api_key: str | None = None, *, timeout: float | None = None,
                 tls: bool = False, root_certificates: str | Path | None = None):
        super().__init__(api_key, timeout)
        if tls or root_certificates:
            self._channel = grpc.secure_channel(target, _credentials(root_certificates))
        else:
            self._channel = grpc.insecure_channel(target)
        self._stub = pb_grpc.KVRelayStub(self._channel)

    def stream(self, prompt: str | None = None, **kwargs: Any) -> Iterator[Chunk]:
        """Stream a completion; closing the iterator early cancels the request on the server."""
        call = self._stub.Generate(build_request(prompt, **kwargs), metadata=self._metadata, timeout=self.timeout)
        try:
            for resp in call:
                yield _chunk(resp)
        except grpc.RpcError as e:
            raise KVRelayError.from_rpc_error(e) from None
        finally:
            call.cancel()  # a no-op once the call has ended

    def generate(self, prompt: str | None = None, **kwargs: Any) -> Completion:
        collector = _Collector()
        for chunk in self.stream(prompt, **kwargs):
            collector.add(chunk)
        return collector.result()

    def chat(self, messages: Sequence[dict[str, str]], **kwargs: Any) -> Completion:
        return self.generate(messages=messages, **kwargs)

    def list_models(self) -> list[ModelInfo]:
        try:
            resp = self._stub.ListModels(pb.ListModelsRequest(), metadata=self._metadata, timeout=self.timeout)
        except grpc.RpcError as e:
            raise KVRelayError.from_rpc_error(e) from None
        return [ModelInfo(m.id, m.max_model_len, m.vocab_size, m.tokenizer_dir) for m in resp.models]

    def status(self) -> ClusterStatus:
        try:
            resp = self._stub.GetStatus(pb.GetStatusRequest(), metadata=self._metadata, timeout=self.timeout)
        except grpc.RpcError as e:
            raise KVRelayError.from_rpc_error(e) from None
        return _status(resp)

    def profile(self, seconds: float, out_dir: str) -> list[ProfileTrace]:
        """Profile every replica for ``seconds``; the Chrome traces they wrote
        (each on its replica's host). The call lasts ``seconds`` plus the export."""
        try:
            resp = self._stub.Profile(pb.ProfileRequest(seconds=seconds, out_dir=out_dir),
                                      metadata=self._metadata, timeout=self.timeout)
        except grpc.RpcError as e:
            raise KVRelayError.from_rpc_error(e) from None
        return _traces(resp)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "KVRelayClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncKVRelayClient(_Base):
    """asyncio client; create it inside the event loop that uses it."""

    def __init__(self, target: str, api_key: str | None = None, *, timeout: float | None = None,
                 tls: bool = False, root_certificates: str | Path | None = None):
        super().__init__(api_key, timeout)
        if tls or root_certificates:
            self._channel = grpc.aio.secure_channel(target, _credentials(root_certificates))
        else:
            self._channel = grpc.aio.insecure_channel(target)
        self._stub = pb_grpc.KVRelayStub(self._channel)

    async def stream(self, prompt: str | None = None, **kwargs: Any) -> AsyncIterator[Chunk]:
        call = self._stub.Generate(build_request(prompt, **kwargs), metadata=self._metadata, timeout=self.timeout)
        try:
            async for resp in call:
                yield _chunk(resp)
        except grpc.RpcError as e:
            raise KVRelayError.from_rpc_error(e) from None
        finally:
            call.cancel()

    async def generate(self, prompt: str | None = None, **kwargs: Any) -> Completion:
        collector = _Collector()
        async for chunk in self.stream(prompt, **kwargs):
            collector.add(chunk)
        return collector.result()

    async def chat(self, messages: Sequence[dict[str, str]], **kwargs: Any) -> Completion:
        return await self.generate(messages=messages, **kwargs)

    async def list_models(self) -> list[ModelInfo]:
        try:
            resp = await self._stub.ListModels(pb.ListModelsRequest(), metadata=self._metadata, timeout=self.timeout)
        except grpc.RpcError as e:
            raise KVRelayError.from_rpc_error(e) from None
        return [ModelInfo(m.id, m.max_model_len, m.vocab_size, m.tokenizer_dir) for m in resp.models]

    async def status(self) -> ClusterStatus:
        try:
            resp = await self._stub.GetStatus(pb.GetStatusRequest(), metadata=self._metadata, timeout=self.timeout)
        except grpc.RpcError as e:
            raise KVRelayError.from_rpc_error(e) from None
        return _status(resp)

    async def profile(self, seconds: float, out_dir: str) -> list[ProfileTrace]:
        try:
            resp = await self._stub.Profile(pb.ProfileRequest(seconds=seconds, out_dir=out_dir),
                                            metadata=self._metadata, timeout=self.timeout)
        except grpc.RpcError as e:
            raise KVRelayError.from_rpc_error(e) from None
        return _traces(resp)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "AsyncKVRelayClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
