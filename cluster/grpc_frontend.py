"""The gRPC frontend: `kvrelay.v1.KVRelay` over a `Backend`.

A Generate call: authenticate (``authorization: Bearer <key>`` when keys are
configured) → check the model → tokenize (text, or chat messages through the
chat template, or token ids as given) → validate (`cluster.validation`) →
stream the backend's deltas (`cluster.serving.run_request`, which also records
the metrics). If the client goes away, or the call fails, the request is
aborted in the backend. Errors map to status codes as on the HTTP frontend
(`cluster.errors`: INVALID_ARGUMENT, RESOURCE_EXHAUSTED, UNAVAILABLE for any
failure inside the cluster, DEADLINE_EXCEEDED), a missing or wrong key to
UNAUTHENTICATED, and bytes that are not the RPC's request message to
INVALID_ARGUMENT (logged at most once a minute, never a traceback per call).

The server also carries grpc.health.v1, following replica liveness as HTTP
``/health`` does (`cluster.health`), and server reflection v1 and v1alpha
(`cluster.reflection`). Protobuf stops here: the backend sees only
`cluster.types`.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from pathlib import Path

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2_grpc

from cluster import errors, reflection
from cluster.backend import Backend
from cluster.health import GrpcHealth
from cluster.metrics import ServingMetrics
from cluster.serving import ApiKeys, encode_bad_words, encode_chat, encode_text, run_request
from cluster.configs import FrontendConfig
from cluster.types import (ClusterStatus, FinishReason, GenerateDelta, GenerateRequest, InvalidRequestError,
                           RequestTimeline, TokenLogprob)
from cluster.validation import check_model, check_request_id, truncate_prompt, validate_request
from engine.guided import GuidedError, GuidedSpec
from protos.kvrelay.v1 import serving_pb2 as pb
from protos.kvrelay.v1 import serving_pb2_grpc as pb_grpc
from engine.serving.timeouts import within

log = logging.getLogger(__name__)
_log_junk = errors.RateLimitedLog(log)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["KVRelay"].full_name
MAX_PROFILE_S = 600.0
STOP_CONFIRM_S = 10.0  # the most `GrpcFrontend.stop` waits past the grace for gRPC to confirm
_FINISH = {FinishReason.STOP: pb.FINISH_REASON_STOP, FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
           FinishReason.ABORT: pb.FINISH_REASON_ABORT}


class KVRelayServicer(pb_grpc.KVRelayServicer):
    def __init__(self, backend: Backend, api_keys: tuple[str, ...] = (), metrics: ServingMetrics | None = None):
        self.backend = backend
        self._api_keys = ApiKeys(api_keys)
        self.metrics = metrics if metrics is not None else ServingMetrics(backend.model_name)
        self._active: set[str] = set()

    # ---- RPCs ----------------------------------------------------------------
    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        await self._authenticate(context, count_refusal=True)
        try:
            req = self._to_request(request)
        except InvalidRequestError as e:
            self.metrics.count_rejected("grpc", "invalid_request")
            await _abort(context, errors.classify(e))
        if req.request_id in self._active:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"request_id: {errors.quote(req.request_id)} is already running")
        self._active.add(req.request_id)
        failure: errors.Failure | None = None
        try:
            num_generated = 0
            running = run_request(self.backend, req, self.metrics.start_request("grpc", req))
            async with contextlib.aclosing(running) as deltas:
                async for delta in deltas:
                    if delta.finish_reason is FinishReason.ERROR:
                        failure = errors.request_failed(delta.error)
                        break
                    num_generated += len(delta.token_ids)
                    await context.write(self._to_response(delta, req, num_generated))
                    if delta.finish_reason is not None:
                        break
        except asyncio.CancelledError:
            log.info("request %s cancelled by the client", req.request_id)
            raise
        except Exception as e:  # the backend's refusals, and failures inside the cluster (the log gets the trace)
            failure = errors.classify(e)
            if failure.is_unexpected:
                log.exception("request %s failed", req.request_id)
        finally:
            self._active.discard(req.request_id)
        if failure is not None:
            await _abort(context, failure)

    async def ListModels(self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext) -> pb.ListModelsResponse:
        await self._authenticate(context)
        b = self.backend
        return pb.ListModelsResponse(models=[pb.ModelInfo(id=b.model_name, max_model_len=b.max_model_len,
                                                          vocab_size=b.vocab_size,
                                                          tokenizer_dir=getattr(b, "tokenizer_dir", None) or "")])

    async def GetStatus(self, request: pb.GetStatusRequest, context: grpc.aio.ServicerContext) -> pb.GetStatusResponse:
        await self._authenticate(context)
        try:
            status = await self.backend.status()
        except Exception as e:
            log.exception("status failed")
            await context.abort(grpc.StatusCode.UNAVAILABLE, errors.clip(f"status failed: {type(e).__name__}: {e}"))
        return status_to_proto(status)

    async def Profile(self, request: pb.ProfileRequest, context: grpc.aio.ServicerContext) -> pb.ProfileResponse:
        await self._authenticate(context)
        profile = getattr(self.backend, "profile", None)
        if profile is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this backend does not profile")
        if not 0 < request.seconds <= MAX_PROFILE_S:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"seconds: must be in (0, {MAX_PROFILE_S:g}]")
        if not request.out_dir:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "out_dir: must not be empty")
        try:
            traces = await profile(request.seconds, request.out_dir)
        except Exception as e:
            log.exception("profile failed")
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                errors.clip(f"profile failed: {type(e).__name__}: {e}"))
        return pb.ProfileResponse(trace_files=[t.path for t in traces], traces=[
            pb.ProfileTrace(replica_id=t.replica_id, host=t.host, path=t.path) for t in traces])

    # ---- helpers -------------------------------------------------------------
    async def _authenticate(self, context: grpc.aio.ServicerContext, count_refusal: bool = False) -> None:
        if not self._api_keys:
            return
        problem = self._api_keys.check(dict(context.invocation_metadata() or ()).get("authorization"))
        if problem is not None:
            if count_refusal:
                self.metrics.count_rejected("grpc", "unauthenticated")
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, problem)

    def _to_request(self, request: pb.GenerateRequest) -> GenerateRequest:
        b = self.backend
        check_model(request.model, b.model_name)
        if request.request_id:
            check_request_id(request.request_id)
        kind = request.WhichOneof("prompt")
        if kind == "text":
            token_ids = encode_text(b.tokenizer, request.text)
        elif kind == "chat":
            messages = [{"role": m.role, "content": m.content} for m in request.chat.messages]
            token_ids = encode_chat(b.tokenizer, messages, field="chat")
        elif kind == "token_ids":
            token_ids = list(request.token_ids.ids)
        else:
            raise InvalidRequestError("prompt", "give one of text, chat or token_ids")
        s = request.sampling
        opt = lambda name: getattr(s, name) if s.HasField(name) else None  # noqa: E731
        token_ids = truncate_prompt(token_ids, opt("truncate_prompt_tokens"), b.max_model_len)
        sampling = validate_request(
            token_ids, max_model_len=b.max_model_len, vocab_size=b.vocab_size,
            max_tokens=opt("max_tokens"), temperature=opt("temperature"), top_p=opt("top_p"),
            top_k=opt("top_k"), min_p=opt("min_p"), seed=opt("seed"), stop=list(s.stop),
            stop_token_ids=list(s.stop_token_ids), ignore_eos=s.ignore_eos, logprobs=opt("logprobs"),
            prompt_logprobs=opt("prompt_logprobs"), guided=_guided(request),
            guided_field=f"guided.{request.guided.WhichOneof('constraint')}",
            presence_penalty=opt("presence_penalty"), frequency_penalty=opt("frequency_penalty"),
            repetition_penalty=opt("repetition_penalty"), logit_bias=dict(s.logit_bias),
            min_tokens=opt("min_tokens"), include_stop_str_in_output=s.include_stop_str_in_output,
            skip_special_tokens=opt("skip_special_tokens") is not False,
            allowed_token_ids=list(s.allowed_token_ids) or None,
            bad_words_token_ids=encode_bad_words(b.tokenizer, list(s.bad_words) or None),
        )
        return GenerateRequest(request.request_id or uuid.uuid4().hex, token_ids, sampling,
                               timeline=request.timeline)

    @staticmethod
    def _to_response(delta: GenerateDelta, req: GenerateRequest, num_generated: int) -> pb.GenerateResponse:
        resp = pb.GenerateResponse(request_id=req.request_id, text=delta.text, token_ids=delta.token_ids)
        if delta.logprobs:
            resp.logprobs.extend(map(_logprob_to_proto, delta.logprobs))
        if delta.prompt_logprobs:
            resp.prompt_logprobs.extend(map(_logprob_to_proto, delta.prompt_logprobs))
        if delta.finish_reason is not None:
            resp.finish_reason = _FINISH[delta.finish_reason]
            resp.usage.CopyFrom(pb.Usage(prompt_tokens=req.num_prompt_tokens, completion_tokens=num_generated,
                                         cached_prompt_tokens=delta.num_cached_tokens))
            if req.timeline and delta.timeline is not None:
                resp.timeline.CopyFrom(timeline_to_proto(delta.timeline))
        return resp


def _logprob_to_proto(lp: TokenLogprob) -> pb.TokenLogprob:
    return pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, rank=lp.rank,
                           top=[pb.TopLogprob(token_id=t, logprob=p) for t, p in lp.top])


async def _abort(context: grpc.aio.ServicerContext, failure: errors.Failure) -> None:
    await context.abort(grpc.StatusCode[failure.code.grpc_name], failure.message)


def method_handlers(servicer: KVRelayServicer) -> grpc.GenericRpcHandler:
    """The KVRelay service's handlers, as the generated code makes them, except that each parses its own bytes."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            _parsed(servicer.Generate, pb.GenerateRequest), request_deserializer=None,
            response_serializer=pb.GenerateResponse.SerializeToString),
    }
    for name, kind, reply in (("ListModels", pb.ListModelsRequest, pb.ListModelsResponse),
                              ("GetStatus", pb.GetStatusRequest, pb.GetStatusResponse),
                              ("Profile", pb.ProfileRequest, pb.ProfileResponse)):
        handlers[name] = grpc.unary_unary_rpc_method_handler(
            _parsed(getattr(servicer, name), kind), request_deserializer=None,
            response_serializer=reply.SerializeToString)
    return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)


def _parsed(method, kind):
    """``method`` behind a parse of its raw request bytes: junk gets INVALID_ARGUMENT (grpcio's own: UNKNOWN)."""
    async def handler(raw: bytes, context: grpc.aio.ServicerContext):
        try:
            request = kind.FromString(raw)
        except DecodeError as e:
            _log_junk("%s: %d bytes that are not a %s from %s (%s)", method.__name__, len(raw), kind.__name__,
                      context.peer(), e)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request: not a valid {kind.__name__} message")
        return await method(request, context)
    return handler


def timeline_to_proto(t: RequestTimeline) -> pb.RequestTimeline:
    return pb.RequestTimeline(**t.phases())


def status_to_proto(status: ClusterStatus) -> pb.GetStatusResponse:
    """The status; a dead replica's load fields stay unset (its last report is not its load now)."""
    return pb.GetStatusResponse(
        model=status.model_name, mode=status.mode, waiting=status.num_waiting,
        replicas=[_replica_to_proto(r) for r in status.replicas],
    )


def _replica_to_proto(r) -> pb.ReplicaStatus:
    health = dict(state=r.state, restarts=r.num_restarts, last_error=r.last_error,
                  tensor_parallel_size=r.tensor_parallel_size, rank_pids=list(r.rank_pids),
                  quantization=r.quantization, kernel_isa=r.kernel_isa,
                  pipeline_parallel_size=r.pipeline_parallel_size)
    if not r.is_alive:
        return pb.ReplicaStatus(replica_id=r.replica_id, stage=r.stage.value, alive=False, **health)
    return pb.ReplicaStatus(
        replica_id=r.replica_id, stage=r.stage.value, alive=True, running_seqs=r.num_running_seqs,
        queued_prefill_tokens=r.num_queued_prefill_tokens, in_flight=r.num_in_flight,
        free_blocks=r.num_free_blocks, total_blocks=r.num_total_blocks, kv_usage=r.kv_usage, **health)


class GrpcFrontend:
    """An asyncio gRPC server: the KVRelay service, health and reflection."""

    def __init__(self, backend: Backend, config: FrontendConfig, metrics: ServingMetrics | None = None):
        self.config = config
        self.servicer = KVRelayServicer(backend, config.api_keys, metrics)
        self.health = GrpcHealth(backend, ("", SERVICE_NAME), config.health_interval_s)
        self.server: grpc.aio.Server | None = None
        self.port: int | None = None

    async def start(self) -> int:
        """Bind and start serving; returns the bound port (useful with grpc_port 0)."""
        c = self.config
        # gRPC sets SO_REUSEPORT by default on Linux, so a second server on a taken port would silently
        # share it: only the frontends of one deployment may (frontend.reuse_port).
        server = grpc.aio.server(options=[("grpc.so_reuseport", 1 if c.reuse_port else 0)])
        server.add_generic_rpc_handlers((method_handlers(self.servicer),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health.servicer, server)
        reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME), server)
        address = f"{c.host}:{c.grpc_port}"
        if c.tls_cert_file:
            key, cert = Path(c.tls_key_file).read_bytes(), Path(c.tls_cert_file).read_bytes()
            port = server.add_secure_port(address, grpc.ssl_server_credentials([(key, cert)]))
        else:
            port = server.add_insecure_port(address)
        await server.start()
        await self.health.start()
        self.server, self.port = server, port
        log.info("kvrelay gRPC frontend on %s:%d (%s)", c.host, port, "TLS" if c.tls_cert_file else "plaintext")
        return port

    async def stop(self, grace: float | None = 5.0) -> None:
        """Report NOT_SERVING, let running calls finish for ``grace`` seconds, then stop."""
        if self.server is None:
            return
        await self.health.stop()
        server, self.server = self.server, None
        # grpc.aio's stop waits for the core to confirm the shutdown; that confirmation has been seen to
        # go missing (grpc/grpc#28999 and kin), and a frontend must never hang its caller on stop. Calls
        # are already cancelled by then, so waiting longer than the grace plus a margin buys nothing.
        try:
            await within(asyncio.shield(server.stop(grace)), (grace or 0.0) + STOP_CONFIRM_S)
        except asyncio.TimeoutError:
            log.warning("gRPC frontend on port %s: no shutdown confirmation within %.0fs of the grace; going on",
                        self.port, STOP_CONFIRM_S)

    async def wait_for_termination(self) -> None:
        if self.server is not None:
            await self.server.wait_for_termination()


def _guided(request: pb.GenerateRequest) -> GuidedSpec | None:
    """The request's ``guided`` constraint (None when unset); raises `InvalidRequestError` naming it."""
    if not request.HasField("guided"):
        return None
    g = request.guided
    kind = g.WhichOneof("constraint")
    try:
        if kind == "json_schema":
            return GuidedSpec.json_schema(g.json_schema)
        if kind == "json_object":
            return GuidedSpec("json_object") if g.json_object else None
        if kind == "choice":
            return GuidedSpec("choice", choices=tuple(g.choice.choices))
        if kind in ("regex", "grammar"):
            return GuidedSpec(kind, getattr(g, kind))
    except GuidedError as e:
        raise InvalidRequestError(f"guided.{kind}", str(e)) from None
    raise InvalidRequestError("guided", "set one of json_schema, json_object, regex, choice or grammar")
