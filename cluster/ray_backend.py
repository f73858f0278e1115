"""The real `Backend`: the router plus the Ray-hosted stage replicas.

Ray hosts the replicas, reports their load and notices when one dies; the
requests themselves travel over each replica's request channel
(`engine.channel`), a socket between the replica and this process, so
neither starting a request nor any of its tokens waits on a Ray call.

A request's path (disaggregated): the router picks a (prefill, decode) pair;
the prompt goes to the prefill replica and, in the same moment, a
reservation to the decode replica, whose ticket (blocks, lease) is passed
on to the prefill replica as soon as it comes; the prefill replica pushes
the prompt's KV into those blocks. The first token goes to the client from
the prefill replica as soon as it is sampled, without waiting for the KV
transfer; the decode replica then streams the rest, one frame per step (its
copy of the first token is dropped). Colocated: the one replica does it all.

Failures: a prefill that fails (or whose replica goes) fails the decode side
at once, without waiting for the lease; a replica whose channel breaks or
that Ray reports dead ends its requests with an error and is taken out of
the router. Every path releases the placement and aborts what the request
holds.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from collections.abc import AsyncIterator

from cluster.router import ReplicaLoad, Router
from cluster.types import (ClusterStatus, FinishReason, GenerateDelta, GenerateRequest, NoReplicaError, ProfileTrace,
                           RequestTimeline, Stage, StageMetrics, TokenLogprob)
from engine.channel import ChannelError, ChannelServer, FirstToken
from engine.sampling import SamplingParams as EngineSamplingParams

log = logging.getLogger(__name__)


def engine_params(req: GenerateRequest) -> EngineSamplingParams:
    s = req.sampling
    return EngineSamplingParams(
        max_tokens=s.max_tokens, temperature=s.temperature, top_k=max(s.top_k, 0), top_p=s.top_p,
        min_p=s.min_p, seed=s.seed, stop=list(s.stop), stop_token_ids=list(s.stop_token_ids),
        ignore_eos=s.ignore_eos, logprobs=s.logprobs)


def _logprobs(infos, token_ids) -> list[TokenLogprob] | None:
    if not infos:
        return None
    return [TokenLogprob(t, i["token_logprob"], tuple((a, b) for a, b in i["top"]))
            for t, i in zip(token_ids, infos)]


def _skip_first_token(d, first: FirstToken):
    """The decode replica's first delta with tokens, without the first token,
    which the client already has from the prefill replica; None if nothing
    is left of it. Its text is ``first.text``, plus whatever the detokenizer
    held back when the token also ends the request."""
    if d.token_ids[0] != first.token_id:  # cannot happen: both sides have the token from the commit
        log.error("request %s: decode's first token %d is not prefill's %d", d.request_id, d.token_ids[0],
                  first.token_id)
    text = d.text[len(first.text):] if d.text.startswith(first.text) else d.text
    rest = dataclasses.replace(d, token_ids=d.token_ids[1:], text=text,
                               logprobs=d.logprobs[1:] if d.logprobs else None)
    return rest if rest.token_ids or rest.text or rest.finished else None


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
            if isinstance(res, BaseException) or not res.get("is_alive", True):
                self._mark_dead(rid, res)
                continue
            self.router.report_load(ReplicaLoad(
                rid, stage, res["num_queued_prefill_tokens"], res["num_running_seqs"], res["num_free_blocks"],
                res["num_total_blocks"], frozenset(hashes.get(rid, ())), time.monotonic()))
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
                    self.channels.send(decode, ("submit", rid, ids, params))
                else:  # the prompt starts computing while the decode replica reserves its blocks
                    self.channels.send(prefill, ("prefill", rid, ids, params))
                    self.channels.send(decode, ("reserve", rid, ids, params))
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
        """The request's deltas from what its replicas send, up to the one that finishes it."""
        rid = request.request_id
        decode, prefill = placement.decode_replica, placement.prefill_replica
        first: FirstToken | None = None  # disaggregated: the prefill replica's first token, until it is skipped
        prefill_result = None
        cached_tokens = 0
        # disaggregated, decode deltas wait for the prefill replica's first
        # token (it has the logprobs) unless the prefill failed or went
        streaming = prefill is None
        held = []
        while True:
            try:
                kind, payload = await asyncio.wait_for(inbox.get(), self.stall_timeout_s)
            except asyncio.TimeoutError:
                yield GenerateDelta(rid, finish_reason=FinishReason.ERROR,
                                    error=f"no word from the replicas for {self.stall_timeout_s:.0f}s")
                return
            if kind == "delta":
                held.append(payload)
            elif kind == "ticket":
                self._send(prefill, ("attach", rid, payload))
            elif kind == "first":
                first = payload
                cached_tokens = first.num_cached_tokens
                streaming = True
                yield GenerateDelta(rid, [first.token_id], first.text,
                                    logprobs=_logprobs(first.logprobs and [first.logprobs], [first.token_id]))
            elif kind == "result":
                prefill_result = payload
                if payload.status != "DONE":
                    streaming = True
                    self._send(decode, ("fail", rid, f"prefill failed: {payload.error}"))
            elif kind == "error":  # a replica refused a command of this request
                yield GenerateDelta(rid, finish_reason=FinishReason.ERROR, error=payload)
                return
            elif kind == "lost":
                if payload == decode:
                    yield GenerateDelta(rid, finish_reason=FinishReason.ERROR,
                                        error=f"decode replica {decode} died mid-stream")
                    return
                if not streaming:  # the prefill replica went before the first token: the KV will not come
                    streaming = True
                    self._send(decode, ("fail", rid, f"prefill replica {prefill} died"))
            if not held or not (streaming or (held[-1].finished and not held[-1].token_ids)):
                continue  # (an error or abort from the decode side goes out at once)
            for d in held:
                if first is not None and d.token_ids:  # the decode replica's copy of the first token
                    d, first = _skip_first_token(d, first), None
                    if d is None:
                        continue
                delta = self._to_delta(d)
                if delta.finish_reason is not None:
                    if prefill is not None:
                        # The prefill replica reports its result between forward
                        # passes, so under load it can come a whole pass (~1 s for
                        # a long prompt) after the decode side is done: the last
                        # token does not wait for it unless a timeline was asked
                        # for; the stage metrics of this request are then not
                        # recorded.
                        if prefill_result is None:
                            prefill_result = _queued_result(inbox)
                        if prefill_result is None and request.timeline:
                            prefill_result = await self._prefill_result(inbox)
                        if prefill_result is not None:
                            delta.stage_metrics = _stage_metrics(prefill_result)
                        delta.num_cached_tokens = cached_tokens  # the prefix cache that counts is prefill's
                    if request.timeline:
                        delta.timeline = _timeline(request, routed_at, d.metrics, prefill_result,
                                                   colocated=prefill is None)
                    yield delta
                    return
                yield delta
            held.clear()

    async def _prefill_result(self, inbox: asyncio.Queue, timeout_s: float = 1.0):
        """The prefill replica's result, if it comes within ``timeout_s`` (it is only for the metrics)."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                kind, payload = await asyncio.wait_for(inbox.get(), left)
            except asyncio.TimeoutError:
                return None
            if kind == "result":
                return payload
        return None

    def _send(self, replica: str | None, msg: tuple) -> None:
        """A command that may find its replica gone: then the request hears "lost" instead."""
        if replica is None:
            return
        try:
            self.channels.send(replica, msg)
        except ChannelError:
            pass

    @staticmethod
    def _to_delta(d) -> GenerateDelta:
        finish = FinishReason(d.finish_reason) if d.finish_reason else None
        logprobs = _logprobs(d.logprobs, d.token_ids)
        return GenerateDelta(d.request_id, list(d.token_ids), d.text, finish, logprobs,
                             d.num_cached_tokens, d.error)

    def _abort_on(self, rid: str, placement) -> None:
        for replica in (placement.decode_replica, placement.prefill_replica):
            self._send(replica, ("abort", rid))

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
            self._send(replica, ("abort", request_id))

    async def status(self) -> ClusterStatus:
        return ClusterStatus(self.model_name, self.mode, self.router.replica_statuses(), self.router.num_waiting)


def _queued_result(inbox: asyncio.Queue):
    """The prefill replica's result if it is already in the inbox (other messages there are spent)."""
    while not inbox.empty():
        kind, payload = inbox.get_nowait()
        if kind == "result":
            return payload
    return None


def _stage_metrics(result) -> StageMetrics:
    t = result.timings
    return StageMetrics(t.get("queue_time_s"), t.get("prefill_time_s"), t.get("kv_transfer_time_s"),
                        int(t.get("kv_transfer_bytes", 0)), 0 if result.status == "DONE" else 1)


def _timeline(request: GenerateRequest, routed_at: float, decode_metrics: dict, prefill_result,
              colocated: bool) -> RequestTimeline:
    """The request's phases from the wall-clock stamps of the frontend, the
    prefill result and the decode replica's final metrics."""
    t0 = request.arrival_wall_time
    dw = (decode_metrics or {}).get("wall_times", {})
    if colocated:
        stamps = {"prefill_queued_s": dw.get("arrival"), "prefill_start_s": dw.get("first_scheduled"),
                  "prefill_end_s": dw.get("first_token")}
    else:
        pw = prefill_result.timings.get("wall_times", {}) if prefill_result is not None else {}
        stamps = {"prefill_queued_s": pw.get("prefill_queued"), "prefill_start_s": pw.get("prefill_start"),
                  "prefill_end_s": pw.get("prefill_end"), "kv_transfer_done_s": dw.get("kv_ready")}
    stamps.update(routed_s=routed_at, first_decode_step_s=dw.get("first_decode"), finish_s=time.time())
    return RequestTimeline(**{k: v - t0 for k, v in stamps.items() if v is not None})
