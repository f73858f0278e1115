"""The real `Backend`: the router plus the Ray-hosted stage replicas.

A request's path (disaggregated): the router picks a (prefill, decode) pair;
the prefill replica starts the prompt while the decode replica reserves
blocks and returns a ticket, which follows to the prefill replica; the
prefill replica pushes the prompt's KV into those blocks; the decode replica
streams tokens, which come back here as batches of deltas over a Ray
streaming generator. Colocated: the one replica does it all.

The first token takes a shorter way: the replica that samples it (prefill,
or colocated) sends it straight to this process's first-token sink
(`engine.token_sink`), and, disaggregated, in the prefill result stream too;
it goes to the client from whichever copy comes first, without waiting for
the KV transfer, and the decode stream's copy is dropped.

Failures: a prefill that fails (or whose replica dies) fails the decode side
at once, without waiting for the lease; a decode replica that dies ends its
streams with an error and is taken out of the router. Every path releases
the placement and aborts what the request holds.
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
from engine.sampling import SamplingParams as EngineSamplingParams
from engine.token_sink import FirstToken, TokenSinkServer

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


def _skip_first_token(batch: list, first) -> list:
    """The decode replica's deltas without the first token, which the client
    already has (``first``, a `engine.token_sink.FirstToken`).

    The decode replica emits that token as a delta of its own; its text is
    ``first.text``, plus whatever the detokenizer held back when the token
    also ends the request."""
    for i, d in enumerate(batch):
        if not d.token_ids:
            continue
        if d.token_ids[0] != first.token_id:  # cannot happen: both sides have the token from the commit
            log.error("request %s: decode's first token %d is not prefill's %d", d.request_id, d.token_ids[0],
                      first.token_id)
        text = d.text[len(first.text):] if d.text.startswith(first.text) else d.text
        rest = dataclasses.replace(d, token_ids=d.token_ids[1:], text=text,
                                   logprobs=d.logprobs[1:] if d.logprobs else None)
        if rest.token_ids or rest.text or rest.finished:
            return batch[:i] + [rest] + batch[i + 1:]
        return batch[:i] + batch[i + 1:]
    return batch


class RayBackend:
    def __init__(self, model_name: str, mode: str, tokenizer, max_model_len: int, vocab_size: int,
                 router: Router, replicas: dict[str, tuple[Stage, object]], load_interval_s: float = 0.05,
                 sink_host: str | None = "127.0.0.1", sink_advertise_host: str | None = None):
        """``sink_host``: where the first-token sink (`engine.token_sink`)
        listens, None for none; replicas reach it at ``sink_advertise_host``
        (default: ``sink_host``)."""
        self.model_name = model_name
        self.mode = mode
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.router = router
        self.replicas = replicas  # replica id -> (stage, actor handle)
        self.load_interval_s = load_interval_s
        self._poller: asyncio.Task | None = None
        self.sink = TokenSinkServer(os.urandom(32), sink_host, sink_advertise_host) if sink_host else None

    async def start(self) -> None:
        for rid, (stage, _) in self.replicas.items():
            self.router.add_replica(rid, stage)
        if self.sink is not None:
            address = await self.sink.start()
            await asyncio.gather(*(h.connect_token_sink.remote(address, self.sink.secret)
                                   for _, h in self.replicas.values()))
        await self._poll_loads_once()
        self._poller = asyncio.create_task(self._poll_loads())

    async def stop(self) -> None:
        if self.sink is not None:
            await self.sink.stop()
        if self._poller is not None:
            self._poller.cancel()
            try:
                await self._poller
            except asyncio.CancelledError:
                pass

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

    def _mark_dead(self, rid: str, why) -> None:
        for r in self.router.replicas():
            if r.replica_id == rid and r.is_alive:
                log.error("replica %s is down: %s", rid, why)
                self.router.mark_dead(rid)

    # ---- requests ----------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateDelta]:
        import ray

        placement = await self.router.acquire(request)
        routed_at = time.time()
        rid = request.request_id
        params = engine_params(request)
        ids = request.prompt_token_ids
        decode = self.replicas[placement.decode_replica][1]
        prefill = self.replicas[placement.prefill_replica][1] if placement.prefill_replica else None
        watcher: asyncio.Task | None = None
        prefill_box: dict = {}
        # the first token, by the sink or (disaggregated) the prefill replica's result, whichever comes first
        first_token = self.sink.wait(rid) if self.sink else asyncio.get_running_loop().create_future()
        sink = self.sink.address if self.sink else None
        finished = False
        try:
            try:
                if prefill is None:
                    await decode.submit.remote(rid, ids, params, sink)
                else:
                    # the prompt starts computing while the decode replica reserves
                    # its blocks; the ticket follows (one round trip off the TTFT)
                    events = prefill.prefill_stream.options(num_returns="streaming").remote(
                        rid, ids, params, None, sink)
                    watcher = asyncio.create_task(self._watch_prefill(
                        events, placement, decode, rid, prefill_box, first_token))
                    ticket = await decode.reserve.remote(rid, ids, params)
                    prefill.attach_ticket.remote(rid, ticket)
            except ray.exceptions.RayActorError as e:
                self._mark_dead(placement.decode_replica, e)
                raise NoReplicaError(f"decode replica {placement.decode_replica} is down") from e
            stream = decode.stream.options(num_returns="streaming").remote(rid)
            batches = self._batches(stream, first_token, is_colocated=prefill is None)
            try:
                async for batch in batches:
                    for d in batch:
                        delta = d if isinstance(d, GenerateDelta) else self._to_delta(d)
                        if delta.finish_reason is not None:
                            finished = True
                            if watcher is not None:
                                delta.stage_metrics = await self._stage_metrics(watcher, prefill_box)
                                if "result" in prefill_box:  # the prefix cache that counts is prefill's
                                    delta.num_cached_tokens = prefill_box["result"].num_cached_tokens
                            if request.timeline:
                                delta.timeline = _timeline(request, routed_at, d.metrics, prefill_box.get("result"),
                                                           colocated=prefill is None)
                        yield delta
                        if finished:
                            return
            except ray.exceptions.RayActorError as e:
                self._mark_dead(placement.decode_replica, e)
                finished = True
                yield GenerateDelta(rid, finish_reason=FinishReason.ERROR,
                                    error=f"decode replica {placement.decode_replica} died mid-stream")
                return
            finally:
                await batches.aclose()
            finished = True
            yield GenerateDelta(rid, finish_reason=FinishReason.ERROR, error="stream ended without a finish")
        finally:
            self.router.release(placement)
            if self.sink is not None:
                self.sink.discard(rid)
            if watcher is not None and not watcher.done():
                watcher.cancel()
            if not finished:  # the consumer went away, or we failed: free everything
                await self._abort_on(rid, placement)

    async def _batches(self, stream, first_token: asyncio.Future, is_colocated: bool):
        """The decode stream's batches of deltas, the first token first as soon
        as ``first_token`` has it; the stream's copy of it is then left out.

        Disaggregated, the first token comes from the prefill replica (with
        its logprobs), without waiting for the KV transfer, and the stream's
        first token is never used without it. Colocated, the stream's first
        batch is used as it is if it comes first. A decode stream that fails
        or ends before the first token (its replica died, the transfer
        failed) is passed on at once."""
        pending = asyncio.ensure_future(stream.__anext__())
        try:
            await asyncio.wait((first_token, pending), return_when=asyncio.FIRST_COMPLETED)
            batch = None
            if first_token.done():
                first = first_token.result()  # None: the prefill failed; the decode stream says why
            elif pending.exception() is not None:
                first = None  # raised below
            else:  # the decode side spoke first
                batch = await pending.result()
                # an error or abort: no first token to wait for; else (disaggregated) it is on its way
                first = await first_token if any(d.token_ids for d in batch) and not is_colocated else None
            if first is not None:
                yield [GenerateDelta(first.request_id, [first.token_id], first.text,
                                     logprobs=_logprobs(first.logprobs and [first.logprobs], [first.token_id]))]
            if batch is None:
                batch = await (await pending)  # raises if the decode replica died
        except StopAsyncIteration:
            return
        finally:
            if not pending.done():
                pending.cancel()
        if first is not None:
            batch = _skip_first_token(batch, first)
        if batch:
            yield batch
        async for ref in stream:
            yield await ref

    async def _watch_prefill(self, events, placement, decode, rid: str, box: dict,
                             first_token: asyncio.Future) -> None:
        import ray

        result = None
        try:
            async for ref in events:
                item = await ref
                if isinstance(item, FirstToken):
                    if not first_token.done():
                        first_token.set_result(item)
                else:
                    result = item
        except ray.exceptions.RayActorError as e:
            self._mark_dead(placement.prefill_replica, e)
            box["error"] = f"prefill replica {placement.prefill_replica} died"
        except Exception as e:
            box["error"] = f"prefill failed: {type(e).__name__}: {e}"
        finally:
            if not first_token.done():
                first_token.set_result(None)
        if result is not None:
            box["result"] = result
            if result.status == "DONE":
                return
            box["error"] = f"prefill failed: {result.error}"
        box.setdefault("error", "prefill ended without a result")
        try:
            await decode.fail.remote(rid, box["error"])
        except Exception:
            pass

    async def _stage_metrics(self, watcher: asyncio.Task, box: dict) -> StageMetrics | None:
        try:
            await asyncio.wait_for(asyncio.shield(watcher), 1.0)
        except Exception:
            pass
        result = box.get("result")
        if result is None:
            return StageMetrics(num_kv_transfer_failures=1)
        t = result.timings
        return StageMetrics(t.get("queue_time_s"), t.get("prefill_time_s"), t.get("kv_transfer_time_s"),
                            int(t.get("kv_transfer_bytes", 0)), 0 if result.status == "DONE" else 1)

    @staticmethod
    def _to_delta(d) -> GenerateDelta:
        finish = FinishReason(d.finish_reason) if d.finish_reason else None
        logprobs = _logprobs(d.logprobs, d.token_ids)
        return GenerateDelta(d.request_id, list(d.token_ids), d.text, finish, logprobs,
                             d.num_cached_tokens, d.error)

    async def _abort_on(self, rid: str, placement) -> None:
        for replica in (placement.decode_replica, placement.prefill_replica):
            if replica is None:
                continue
            try:
                await asyncio.wait_for(self.replicas[replica][1].abort.remote(rid), 5.0)
            except Exception:
                pass

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
        await asyncio.gather(*(h.abort.remote(request_id) for _, h in self.replicas.values()),
                             return_exceptions=True)

    async def status(self) -> ClusterStatus:
        return ClusterStatus(self.model_name, self.mode, self.router.replica_statuses(), self.router.num_waiting)


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
