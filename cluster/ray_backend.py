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

Failures: a prefill that fails (or whose replica goes) fails the decode side
at once, without waiting for the lease; a replica whose channel breaks or
that Ray reports dead ends its requests with an error and is taken out of
the router. Every path releases the placement and aborts what the request
holds.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator

from cluster.router import ReplicaLoad, Router
from cluster.types import (ClusterStatus, FinishReason, GenerateDelta, GenerateRequest, NoReplicaError, ProfileTrace,
                           RequestTimeline, Stage, StageMetrics, StageTimings)
from engine.sampling import SamplingParams as EngineSamplingParams
from engine.serving.channel import ChannelError, ChannelServer
from engine.serving.frames import (Abort, Attach, Fail, FirstToken, Lost, Prefill, PrefillDone, Refused, Reserve,
                                   Submit, TicketReady)

log = logging.getLogger(__name__)


def engine_params(req: GenerateRequest) -> EngineSamplingParams:
    s = req.sampling
    return EngineSamplingParams(
        max_tokens=s.max_tokens, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
        min_p=s.min_p, seed=s.seed, stop=list(s.stop), stop_token_ids=list(s.stop_token_ids),
        ignore_eos=s.ignore_eos, logprobs=s.logprobs)


class RayBackend:
    def __init__(self, model_name: str, mode: str, tokenizer, max_model_len: int, vocab_size: int,
                 router: Router, replicas: dict[str, tuple[Stage, object]], load_interval_s: float = 0.05,
                 channel_host: str = "127.0.0.1", channel_advertise_host: str | None = None,
                 connect_timeout_s: float = 60.0, stall_timeout_s: float = 600.0):
        """``channel_host``: where the request channel (`engine.channel`)
        listens; replicas reach it at ``channel_advertise_host`` (default:
        ``channel_host``). ``stall_timeout_s``: a request that hears nothing
        from its replicas for this long ends with an error."""
        self.model_name = model_name
        self.mode = mode
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.router = router
        self.replicas = replicas  # replica id -> (stage, actor handle)
        self.load_interval_s = load_interval_s
        self.connect_timeout_s = connect_timeout_s
        self.stall_timeout_s = stall_timeout_s
        self._poller: asyncio.Task | None = None
        self._reconnecting: set[str] = set()
        self.channels = ChannelServer(os.urandom(32), channel_host, channel_advertise_host,
                                      on_lost=lambda rid: self._mark_dead(rid, "its request channel broke"))

    async def start(self) -> None:
        for rid, (stage, _) in self.replicas.items():
            self.router.add_replica(rid, stage)
        address = await self.channels.start()
        await asyncio.gather(*(h.connect_channel.remote(address, self.channels.secret)
                               for _, h in self.replicas.values()))
        await self.channels.wait_connected(self.replicas, self.connect_timeout_s)
        await self._poll_loads_once()
        self._poller = asyncio.create_task(self._poll_loads())

    async def stop(self) -> None:
        self.channels.on_lost = None  # the replicas are not failing: we are going
        if self._poller is not None:
            self._poller.cancel()
            try:
                await self._poller
            except asyncio.CancelledError:
                pass
        await self.channels.stop()

    # ---- load reports ------------------------------------------------------
    async def _poll_loads(self) -> None:
        while True:
            await asyncio.sleep(self.load_interval_s)
            try:
                await self._poll_loads_once()
            except Exception:  # keep polling whatever one round hit
                log.exception("load poll failed")

    async def _poll_loads_once(self) -> None:
        ids = list(self.replicas)
        results = await asyncio.gather(*(self.replicas[i][1].load.remote() for i in ids), return_exceptions=True)
        prefix = self.router.config.policy == "prefix_aware"
        hashes = {}
        if prefix:
            want = [i for i, r in zip(ids, results) if not isinstance(r, BaseException)
                    and self.replicas[i][0] is not Stage.DECODE]
            got = await asyncio.gather(*(self.replicas[i][1].cached_block_hashes.remote() for i in want),
                                       return_exceptions=True)
            hashes = {i: h for i, h in zip(want, got) if not isinstance(h, BaseException)}
        for rid, res in zip(ids, results):
            stage = self.replicas[rid][0]
            if isinstance(res, BaseException) or not res.is_alive:
                self._mark_dead(rid, res if isinstance(res, BaseException) else "its stage loop died")
                continue
            self.router.report_load(ReplicaLoad(
                rid, stage, res.num_queued_prefill_tokens, res.num_running_seqs, res.num_free_blocks,
                res.num_total_blocks, frozenset(hashes.get(rid, ())), time.monotonic()))
            if not self.channels.is_connected(rid) and rid not in self._reconnecting:
                self._reconnecting.add(rid)
                asyncio.create_task(self._reconnect(rid))

    async def _reconnect(self, rid: str) -> None:
        """A replica that Ray says is alive but whose channel broke: dial again, then place on it again."""
        try:
            await self.replicas[rid][1].connect_channel.remote(self.channels.address, self.channels.secret)
            await self.channels.wait_connected([rid], self.connect_timeout_s)
            self.router.mark_alive(rid)
            log.warning("replica %s: request channel back", rid)
        except Exception as e:
            log.warning("replica %s: request channel still down: %s", rid, e)
        finally:
            self._reconnecting.discard(rid)

    def _mark_dead(self, rid: str, why) -> None:
        for r in self.router.replicas():
            if r.replica_id == rid and r.is_alive:
                log.error("replica %s is down: %s", rid, why)
                self.router.mark_dead(rid)
        self.channels.drop(rid)  # its requests end now, not when (if ever) the socket notices

    # ---- requests ----------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateDelta]:
        placement = await self.router.acquire(request)
        routed_at = time.time()
        rid = request.request_id
        params = engine_params(request)
        ids = request.prompt_token_ids
        decode, prefill = placement.decode_replica, placement.prefill_replica
        finished = False
        try:
            try:
                inbox = self.channels.open(rid, [decode] + ([prefill] if prefill else []))
            except ChannelError as e:
                raise NoReplicaError(str(e)) from e
            try:
                if prefill is None:
                    self.channels.send(decode, Submit(rid, ids, params))
                else:  # the prompt starts computing while the decode replica reserves its blocks
                    self.channels.send(prefill, Prefill(rid, ids, params))
                    self.channels.send(decode, Reserve(rid, ids, params))
            except ChannelError as e:
                raise NoReplicaError(str(e)) from e
            async for delta in self._deltas(request, inbox, placement, routed_at):
                finished = delta.finish_reason is not None
                yield delta
                if finished:
                    return
        finally:
            self.router.release(placement)
            self.channels.close(rid)
            if not finished:  # the consumer went away, or we failed: free everything
                self._abort_on(rid, placement)

    async def _deltas(self, request: GenerateRequest, inbox: asyncio.Queue, placement,
                      routed_at: float) -> AsyncIterator[GenerateDelta]:
        """The request's deltas as its replicas send them, up to the one that finishes it."""
        rid = request.request_id
        decode, prefill = placement.decode_replica, placement.prefill_replica
        done: PrefillDone | None = None  # the prefill replica's word that the request is over there
        cached_tokens = 0
        # The first token and the decode replica's later ones ride different
        # sockets: a decode delta that overtakes the first token waits for it.
        has_first = prefill is None
        overtaking: list[GenerateDelta] = []
        while True:
            try:
                event = await asyncio.wait_for(inbox.get(), self.stall_timeout_s)
            except asyncio.TimeoutError:
                yield GenerateDelta(rid, finish_reason=FinishReason.ERROR,
                                    error=f"no word from the replicas for {self.stall_timeout_s:.0f}s")
                return
            if isinstance(event, GenerateDelta):
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
                    self._send(decode, Fail(rid, f"prefill failed: {done.error}"))
                continue
            elif isinstance(event, Refused):  # a replica could not take a command of this request
                yield GenerateDelta(rid, finish_reason=FinishReason.ERROR, error=event.error)
                return
            elif isinstance(event, Lost):
                if event.replica_id == decode:
                    yield GenerateDelta(rid, finish_reason=FinishReason.ERROR,
                                        error=f"decode replica {decode} died mid-stream")
                    return
                if not has_first:  # the prefill replica went before the first token: the KV will not come
                    overtaking.clear()
                    self._send(decode, Fail(rid, f"prefill replica {prefill} died"))
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
        for (rid, _), path, host in zip(ok, paths, hosts):
            if isinstance(path, BaseException):
                raise RuntimeError(f"profile could not stop on {rid}: {path}")
            traces.append(ProfileTrace(rid, host if isinstance(host, str) else "?", path))
        return traces

    async def abort(self, request_id: str) -> None:
        for replica in self.replicas:
            self._send(replica, Abort(request_id))

    async def status(self) -> ClusterStatus:
        return ClusterStatus(self.model_name, self.mode, self.router.replica_statuses(), self.router.num_waiting)


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
            event = await asyncio.wait_for(inbox.get(), left)
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
