"""The real `Backend`: the router plus the Ray-hosted stage replicas.

Ray hosts the replicas, reports their load and notices when one dies; the
requests themselves travel over each replica's request channel
(`engine.serving.channel`), a socket between the replica and this process,
so neither starting a request nor any of its tokens waits on a Ray call.

A request's path (disaggregated): the router picks a (prefill, decode) pair;
a `Prefill` goes to the prefill replica and, in the same moment, a `Reserve`
to the decode replica, whose `TicketReady` (blocks, lease) is passed on to
the prefill replica in an `Attach` as soon as it comes; the prefill replica
pushes the prompt's KV into those blocks. The first token reaches the client
from the prefill replica (`FirstToken`) as soon as it is sampled, without
waiting for the KV transfer; the decode replica streams every later token
(`Deltas`). Each token comes once, from one place, and is forwarded as it
came. Colocated: the one replica does it all, from a `Submit`.

n > 1 (the frontend's choices, `GenerateRequest.fork_of`): choice 0 runs as
above; each later choice is placed beside it on its decode (or colocated)
replica alone (`Router.place_beside`) and sent there as a `Submit` with
``fork_of``, so the prompt is computed once, on the prefill replica, its KV
moves once, and the choices fork from it on the decode replica
(`decode.stage`), each sampling its own first token. A choice that migrates
goes alone, as any request.

Failures: a prefill that fails (or whose replica goes) fails the decode side
at once, without waiting for the lease (a prefill replica lost after the
first token, with the transfer unfinished: `PrefillLost`, which fails it
on the decode replica unless every layer already landed); a replica whose
channel breaks or that Ray reports dead ends its requests with an error and
is taken out of the router. Every path releases the placement and aborts what the request
holds.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from collections.abc import AsyncIterator, Callable

from cluster.replicas import HealthConfig, Replicas, Respawn
from cluster.router import Placement, Router
from cluster.types import (ClusterStatus, FinishReason, GenerateDelta, GenerateRequest, NoReplicaError,
                           OverloadedError, ProfileTrace, RequestTimeline, Stage, StageMetrics, StageTimings)
from engine.sampling import SamplingParams as EngineSamplingParams
from engine.serving.channel import ChannelError, ChannelServer
from engine.serving.frames import (Abort, Attach, FirstToken, Lost, Prefill, PrefillDone, PrefillLost, Refused, Reserve,
                                   Submit, TicketReady)
from engine.serving.timeouts import within

log = logging.getLogger(__name__)


def engine_params(req: GenerateRequest) -> EngineSamplingParams:
    s = req.sampling
    return EngineSamplingParams(
        max_tokens=s.max_tokens, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
        min_p=s.min_p, seed=s.seed, stop=list(s.stop), stop_token_ids=list(s.stop_token_ids),
        ignore_eos=s.ignore_eos, logprobs=s.logprobs, prompt_logprobs=s.prompt_logprobs,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty, repetition_penalty=s.repetition_penalty,
        logit_bias=dict(s.logit_bias), guided=s.guided, min_tokens=s.min_tokens,
        include_stop_str_in_output=s.include_stop_str_in_output, skip_special_tokens=s.skip_special_tokens,
        allowed_token_ids=None if s.allowed_token_ids is None else list(s.allowed_token_ids),
        bad_words_token_ids=[list(w) for w in s.bad_words_token_ids])


class _ReplicaFailure(Exception):
    """The request's replicas failed it (not its input): it may migrate."""

    def __init__(self, cause: str, error: str):
        super().__init__(error)
        self.cause = cause  # decode_lost | prefill_lost | kv_transfer_failed | replica_error | stalled
        self.error = error


class RayBackend:
    def __init__(self, model_name: str, mode: str, tokenizer, max_model_len: int, vocab_size: int,
                 router: Router, replicas: dict[str, tuple[Stage, object]], load_interval_s: float = 0.05,
                 channel_host: str = "127.0.0.1", channel_advertise_host: str | None = None,
                 channel_ports: tuple[int, int] | None = None,
                 connect_timeout_s: float = 60.0, stall_timeout_s: float = 600.0,
                 health: HealthConfig = HealthConfig(), respawn: Respawn | None = None,
                 on_failed: Callable[[str, str], None] | None = None):
        """``channel_host``: where the request channel (`engine.serving.channel`)
        listens (on the first free port of ``channel_ports``, None: any);
        replicas reach it at ``channel_advertise_host`` (default: ``channel_host``). ``stall_timeout_s``: a request that hears nothing
        from its replicas for this long is taken from them (it migrates).
        ``health``: migration limits and how replicas are watched;
        ``respawn``: how the launcher replaces a replica (None: it does not);
        ``on_failed(replica_id, error)``: told when a replica is given up on."""
        self.model_name = model_name
        self.mode = mode
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.tokenizer_dir: str | None = None  # the served checkpoint's folder, tokenizer included
        self.router = router
        self.replicas = replicas  # replica id -> (stage, actor handle), updated when one is replaced
        self.health = health
        self.stall_timeout_s = stall_timeout_s
        self.channels = ChannelServer(os.urandom(32), channel_host, channel_advertise_host,
                                      on_lost=lambda rid: self.watch.lost_channel(rid), ports=channel_ports)
        self.watch = Replicas(router, self.channels, replicas, health, respawn, load_interval_s, connect_timeout_s,
                              on_failed)
        self._attempts: dict[str, tuple[str, Placement]] = {}  # request id -> its current (attempt id, placement)

    async def start(self, tolerate_missing: bool = False) -> None:
        """Listen, and dial every replica. ``tolerate_missing``: a replica that
        cannot be reached now is taken as failed (and replaced or followed)
        instead of failing the start; a frontend that Ray restarted uses it."""
        await self.channels.start()
        await self.watch.start(tolerate_missing)

    async def stop(self) -> None:
        self.channels.on_lost = None  # the replicas are not failing: we are going
        await self.watch.stop()
        await self.channels.stop()

    # ---- requests ----------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateDelta]:
        """The request's deltas. If its replicas fail it (one dies, stalls or
        its KV transfer fails), it is placed again, resuming after the tokens
        already streamed, up to ``health.migration_limit`` times: the client
        sees one stream. Each placement runs under its own attempt id on the
        replicas, so what is left of an earlier one never collides with it."""
        rid = request.request_id
        routed_at = time.time()
        params = engine_params(request)
        emitted: list[int] = []  # the tokens the client has
        causes: list[str] = []  # why each migration happened
        num_unreachable = 0
        while True:
            sibling = self._attempts.get(request.fork_of) if request.fork_of and not causes else None
            placement = self.router.place_beside(request, sibling[1]) if sibling else None
            fork_of = sibling[0] if placement is not None else None
            try:
                placement = placement or await self.router.acquire(request)
            except (NoReplicaError, OverloadedError) as e:
                if not causes:
                    raise
                yield _lost(rid, causes, f"no replica to migrate to: {e}")
                return
            attempt = rid if not causes and not num_unreachable else f"{rid}#{len(causes) + num_unreachable}"
            self._attempts[rid] = (attempt, placement)
            finished = released = False
            try:
                inbox = self._start_attempt(attempt, placement, request.prompt_token_ids, params, emitted, fork_of)
                async for delta in self._deltas(request, attempt, inbox, placement, routed_at):
                    if attempt != rid:
                        delta.request_id = rid
                    emitted.extend(delta.token_ids)
                    if delta.is_finished:
                        finished = released = True
                        delta.migrations = tuple(causes)
                        # its capacity goes to the next request now, not once the consumer comes back for
                        # more: it may be reading other streams first (a response's several choices)
                        self.router.release(placement)
                    yield delta
                    if finished:
                        return
            except ChannelError as e:  # the placement could not reach a replica: try another, not a migration
                num_unreachable += 1
                if num_unreachable > max(3, len(self.replicas)):
                    if not emitted:
                        raise NoReplicaError(str(e)) from e
                    yield _lost(rid, causes, str(e))
                    return
                log.warning("request %s: %s; placing it again", rid, e)
            except _ReplicaFailure as f:
                why = self._why_not_migrate(causes, emitted)
                if why:
                    yield _lost(rid, causes + [f.cause], f"{f.error} ({why})")
                    return
                causes.append(f.cause)
                log.warning("request %s: %s; migrating it after %d tokens (migration %d of %d)", rid, f.error,
                            len(emitted), len(causes), self.health.migration_limit)
            finally:
                if not released:
                    self.router.release(placement)
                self.channels.close(attempt)
                if not finished:  # the consumer went away, or the replicas failed it: free what they hold
                    self._abort_on(attempt, placement)
                if self._attempts.get(rid, (None,))[0] == attempt:
                    del self._attempts[rid]

    def _start_attempt(self, attempt: str, placement: Placement, prompt: list[int], params,
                       emitted: list[int], fork_of: str | None = None) -> asyncio.Queue:
        """Open the attempt's inbox and send its first commands (raises ChannelError). ``fork_of``: a sibling
        choice's attempt on the same decode (or colocated) replica, whose prompt blocks this one shares there."""
        decode, prefill = placement.decode_replica, placement.prefill_replica
        inbox = self.channels.open(attempt, [decode] + ([prefill] if prefill else []))
        # the prompt's logprobs come with the first token, from the replica computing the prompt: not from a
        # decode replica's, nor again once the client has them (a migration after tokens were streamed)
        unscored = params if params.prompt_logprobs is None else dataclasses.replace(params, prompt_logprobs=None)
        first = unscored if emitted else params
        try:
            if prefill is None:
                self.channels.send(decode, Submit(attempt, prompt, first, list(emitted), fork_of))
            else:  # the prompt starts computing while the decode replica reserves its blocks
                self.channels.send(prefill, Prefill(attempt, prompt, first, list(emitted), fork_of))
                self.channels.send(decode, Reserve(attempt, prompt, unscored, list(emitted)))
        except ChannelError:
            self.channels.close(attempt)
            raise
        return inbox

    def _why_not_migrate(self, causes: list[str], emitted: list[int]) -> str | None:
        limit = self.health.migration_limit
        if len(causes) >= limit:
            return f"migrations exhausted: {len(causes)} of {limit}" if limit else "migration is off"
        if len(emitted) > self.health.migration_max_tokens:
            return (f"{len(emitted)} tokens produced, more than router.migration_max_tokens "
                    f"({self.health.migration_max_tokens}) to migrate")
        return None

    async def _deltas(self, request: GenerateRequest, rid: str, inbox: asyncio.Queue, placement,
                      routed_at: float) -> AsyncIterator[GenerateDelta]:
        """One attempt's deltas as its replicas send them, up to the one that
        finishes it. Raises `_ReplicaFailure` when the replicas fail it."""
        decode, prefill = placement.decode_replica, placement.prefill_replica
        done: PrefillDone | None = None  # the prefill replica's word that the request is over there
        cached_tokens = 0
        # The first token and the decode replica's later ones ride different
        # sockets: a decode delta that overtakes the first token waits for it.
        has_first = prefill is None
        overtaking: list[GenerateDelta] = []
        while True:
            try:
                event = await within(inbox.get(), self.stall_timeout_s)
            except asyncio.TimeoutError:
                raise _ReplicaFailure("stalled", f"no word from the replicas for {self.stall_timeout_s:.0f}s")
            if isinstance(event, GenerateDelta):
                if event.finish_reason is FinishReason.ERROR:  # the replica failed it (a refusal is a Refused)
                    raise _ReplicaFailure("kv_transfer_failed" if "KV transfer" in (event.error or "")
                                          else "replica_error", event.error or "the replica failed the request")
                if not has_first and event.token_ids:
                    overtaking.append(event)
                    continue
                deltas = [event]
            elif isinstance(event, FirstToken):
                cached_tokens = event.delta.num_cached_tokens
                has_first = True
                deltas, overtaking = [event.delta] + overtaking, []
            elif isinstance(event, TicketReady):
                self._send(prefill, Attach(rid, event.ticket))
                continue
            elif isinstance(event, PrefillDone):
                done = event
                if not done.ok:
                    raise _ReplicaFailure("kv_transfer_failed", f"prefill failed: {done.error}")
                continue
            elif isinstance(event, Refused):  # a replica could not take a command of this request
                yield GenerateDelta(rid, finish_reason=FinishReason.ERROR, error=event.error)
                return
            elif isinstance(event, Lost):
                if event.replica_id == decode:
                    raise _ReplicaFailure("decode_lost", f"decode replica {decode} died mid-stream")
                if not has_first:  # the prefill replica went before the first token: the KV will not come
                    raise _ReplicaFailure("prefill_lost", f"prefill replica {prefill} died before the first token")
                if done is None:  # after it, mid-transfer: the decode replica fails the transfer unless it landed
                    self._send(decode, PrefillLost(rid, prefill))
                continue
            else:
                log.error("request %s: an event of unknown type %s", rid, type(event).__name__)
                continue
            for delta in deltas:
                if delta.is_finished:
                    await self._finish(request, delta, inbox, done, cached_tokens, routed_at, prefill is None)
                    yield delta
                    return
                yield delta

    async def _finish(self, request: GenerateRequest, delta: GenerateDelta, inbox: asyncio.Queue,
                      done: PrefillDone | None, cached_tokens: int, routed_at: float, colocated: bool) -> None:
        """What only the backend knows goes on the last delta: the prefill
        replica's metrics and cached tokens, and the timeline if asked for."""
        if not colocated:
            # The prefill replica reports PrefillDone between forward passes,
            # so under load it can come a whole pass (~1 s for a long prompt)
            # after the decode side is done: the last token does not wait for
            # it unless a timeline was asked for; the stage metrics of this
            # request are then not recorded.
            done = done or _queued_done(inbox)
            if done is None and request.timeline:
                done = await _wait_done(inbox)
            if done is not None:
                delta.stage_metrics = _stage_metrics(done)
            delta.num_cached_tokens = cached_tokens  # the prefix cache that counts is prefill's
        if request.timeline:
            delta.timeline = _timeline(request, routed_at, delta.timings, done.timings if done else None,
                                       colocated)

    def _send(self, replica: str | None, frame) -> None:
        """A command that may find its replica gone: then the request hears `Lost` instead."""
        if replica is None:
            return
        try:
            self.channels.send(replica, frame)
        except ChannelError:
            pass

    def _abort_on(self, rid: str, placement) -> None:
        for replica in (placement.decode_replica, placement.prefill_replica):
            self._send(replica, Abort(rid))

    async def profile(self, seconds: float, out_dir: str, with_stack: bool = False) -> list[ProfileTrace]:
        """Record a profiler window of ``seconds`` on every live replica; each
        writes a Chrome trace into ``out_dir`` on its own host."""
        alive = {r.replica_id for r in self.router.replicas() if r.is_alive}
        ids = [rid for rid in self.replicas if rid in alive]
        handles = [self.replicas[rid][1] for rid in ids]
        started = await asyncio.gather(*(h.start_profile.remote(out_dir, with_stack) for h in handles),
                                       return_exceptions=True)
        try:
            failed = [(rid, e) for rid, e in zip(ids, started) if isinstance(e, BaseException)]
            if failed:
                rid, e = failed[0]
                raise RuntimeError(f"profile could not start on {rid}: {e}")
            await asyncio.sleep(seconds)
        finally:
            ok = [(rid, h) for rid, h, e in zip(ids, handles, started) if not isinstance(e, BaseException)]
            paths = await asyncio.gather(*(h.stop_profile.remote() for _, h in ok), return_exceptions=True)
            hosts = await asyncio.gather(*(h.host.remote() for _, h in ok), return_exceptions=True)
        traces = []
        for (rid, _), rank_paths, host in zip(ok, paths, hosts):
            if isinstance(rank_paths, BaseException):
                raise RuntimeError(f"profile could not stop on {rid}: {rank_paths}")
            # a trace per rank (a tensor-parallel replica's are named <replica>-rank<r>-...)
            traces += [ProfileTrace(rid, host if isinstance(host, str) else "?", p) for p in rank_paths]
        return traces

    async def abort(self, request_id: str) -> None:
        attempt, placement = self._attempts.get(request_id, (request_id, None))
        for replica in placement.replica_ids if placement is not None else self.replicas:
            self._send(replica, Abort(attempt))

    async def status(self) -> ClusterStatus:
        return ClusterStatus(self.model_name, self.mode, tuple(self.watch.status(s) for s in self.router.replica_statuses()),
                             self.router.num_waiting)


def _lost(rid: str, causes: list[str], error: str) -> GenerateDelta:
    """The last delta of a request its replicas' failures ended."""
    return GenerateDelta(rid, finish_reason=FinishReason.ERROR, error=f"request lost: {error}",
                         migrations=tuple(causes[:-1]) if causes else (), lost_cause=causes[-1] if causes else "")


def _queued_done(inbox: asyncio.Queue) -> PrefillDone | None:
    """The prefill replica's PrefillDone if it is already in the inbox (other events there are spent)."""
    while not inbox.empty():
        event = inbox.get_nowait()
        if isinstance(event, PrefillDone):
            return event
    return None


async def _wait_done(inbox: asyncio.Queue, timeout_s: float = 1.0) -> PrefillDone | None:
    """The prefill replica's PrefillDone, if it comes within ``timeout_s`` (it is only for the metrics)."""
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        try:
            event = await within(inbox.get(), left)
        except asyncio.TimeoutError:
            return None
        if isinstance(event, PrefillDone):
            return event
    return None


def _stage_metrics(done: PrefillDone) -> StageMetrics:
    t = done.timings
    return StageMetrics(t.queue_time_s, t.prefill_time_s, t.kv_transfer_time_s, t.kv_transfer_bytes,
                        0 if done.ok else 1)


def _timeline(request: GenerateRequest, routed_at: float, decode: StageTimings | None,
              prefill: StageTimings | None, colocated: bool) -> RequestTimeline:
    """The request's phases from the wall-clock stamps of the frontend and
    of the replicas' `StageTimings` (a colocated replica's has them all)."""
    t0 = request.arrival_wall_time
    dt = decode or StageTimings()
    pt = dt if colocated else (prefill or StageTimings())
    stamps = {"routed_s": routed_at, "prefill_queued_s": pt.queued, "prefill_start_s": pt.first_scheduled,
              "prefill_end_s": pt.first_token, "kv_transfer_done_s": None if colocated else dt.kv_ready,
              "first_decode_step_s": dt.first_decode, "finish_s": time.time()}
    return RequestTimeline(**{k: v - t0 for k, v in stamps.items() if v is not None})
