"""The replicas as the frontend watches them: load polls, heartbeats and replacement.

Each replica is polled on its own task (``load`` over Ray every
``load_interval_s``), so a replica that stalls delays nobody else's report.
A replica goes through these states:

    serving ──(no answer for heartbeat_timeout_s)──> stalled ──(answers)──> serving
       │                                               │
       │ (Ray reports it dead, its loop died)          │ (still silent after replace_after_s)
       v                                               v
    restarting ──(new actor loaded, channel authenticated)──> serving
       │
       └──(restart_budget spent, or every try failed)──> failed

Leaving ``serving`` takes the replica out of the router and breaks its
request channel, so its requests hear `Lost` at once and migrate
(`cluster.ray_backend`). A replacement is a new actor for the same replica id
(the launcher's ``respawn``), started after a backoff that doubles with each
restart; it rejoins the router only once it answered a load poll and dialled
its request channel back. A replica that keeps dying ends ``failed`` with
its last error, never restarted in a tight loop.
"""
from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from cluster.router import ReplicaLoad, Router
from cluster.types import ReplicaStatus, Stage
from engine.serving.channel import ChannelServer
from engine.serving.timeouts import cancel_and_wait, within

log = logging.getLogger(__name__)
STOP_TIMEOUT_S = 10.0  # the most `Replicas.stop` waits for its watchers to end


@dataclass(frozen=True)
class HealthConfig:
    """Request migration and replica health (spec ``router.migration_*`` and ``health``)."""

    migration_limit: int = 3  # placements again per request after a replica failure; 0: none
    migration_max_tokens: int = 8192  # a request that produced more than this is not migrated
    heartbeat_timeout_s: float = 2.0  # a load poll unanswered this long: the replica is stalled
    replace_after_s: float = 10.0  # a replica stalled this long is replaced
    restart_budget: int = 3  # replacements per replica
    restart_backoff_s: float = 1.0  # before the n-th replacement: backoff * 2**(n-1)
    ready_timeout_s: float = 300.0  # a replacement must load its model within this


class ReplicaState(str, enum.Enum):
    SERVING = "serving"
    STALLED = "stalled"
    RESTARTING = "restarting"
    FAILED = "failed"


@dataclass
class _Health:
    stage: Stage
    state: ReplicaState = ReplicaState.SERVING
    num_restarts: int = 0
    last_error: str = ""
    silent_since: float | None = None  # monotonic time of the first unanswered poll
    rank_pids: tuple[int, ...] = ()  # the replica's ranks as of its last (re)connect, rank 0 first
    expert_load: tuple[int, ...] = ()  # its last load report's tokens per expert (a mixture of experts)
    # its last load report's since-start counters
    num_prompt_tokens_computed: int = 0
    num_kv_bytes_sent: int = 0
    runs: dict[str, str] = field(default_factory=dict)  # its last report's quantization and kernel_isa


# respawn(replica_id, old_handle, restart_number) -> a new actor handle (the old one killed)
Respawn = Callable[[str, object, int], object]


class Replicas:
    """Polls and heals the deployment's replicas. ``handles`` (replica id ->
    (stage, Ray actor handle)) is updated in place when a replica is
    replaced. Event-loop thread only."""

    def __init__(self, router: Router, channels: ChannelServer, handles: dict[str, tuple[Stage, object]],
                 health: HealthConfig, respawn: Respawn | None = None, load_interval_s: float = 0.05,
                 connect_timeout_s: float = 60.0, on_failed: Callable[[str, str], None] | None = None):
        self.router = router
        self.channels = channels
        self.handles = handles
        self.config = health
        self.respawn = respawn
        self.load_interval_s = load_interval_s
        self.connect_timeout_s = connect_timeout_s
        self.on_failed = on_failed
        self._health = {rid: _Health(stage) for rid, (stage, _) in handles.items()}
        self._tasks: list[asyncio.Task] = []
        self._reconnecting: set[str] = set()

    async def start(self, tolerate_missing: bool = False) -> None:
        """Dial every replica's channel, take one load report from each, then
        watch them. A replica that cannot be dialled fails the start, or, with
        ``tolerate_missing``, is replaced (a frontend joining a deployment
        where one is being replaced)."""
        for rid, (stage, _) in self.handles.items():
            self.router.add_replica(rid, stage)
        dialled = await asyncio.gather(*(self._connect(rid) for rid in self.handles),
                                       return_exceptions=tolerate_missing)
        missing = {rid: e for rid, e in zip(self.handles, dialled) if isinstance(e, BaseException)}
        for rid, e in missing.items():
            self._replace(rid, f"unreachable when this frontend started: {type(e).__name__}: {_first_line(e)}")
        await asyncio.gather(*(self._poll(rid) for rid in self.handles if rid not in missing))
        self._tasks += [asyncio.create_task(self._watch(rid)) for rid in self.handles]

    async def stop(self) -> None:
        await cancel_and_wait(self._tasks, STOP_TIMEOUT_S, "replica watchers")
        self._tasks = []

    def handle(self, rid: str):
        return self.handles[rid][1]

    def is_serving(self, rid: str) -> bool:
        return self._health[rid].state is ReplicaState.SERVING

    def status(self, s: ReplicaStatus) -> ReplicaStatus:
        """``s`` with the replica's health; a replica not serving reports no load (its last is stale)."""
        h = self._health[s.replica_id]
        # its ranks as of its last (re)connect, its weights and kernel path as of its last report
        pp = h.runs.get("pipeline_parallel_size", 1)
        what = dict(tensor_parallel_size=max(1, len(h.rank_pids) // pp), rank_pids=h.rank_pids, **h.runs)
        if h.state is ReplicaState.SERVING:
            return replace(s, num_restarts=h.num_restarts, last_error=h.last_error, expert_load=h.expert_load,
                           num_prompt_tokens_computed=h.num_prompt_tokens_computed,
                           num_kv_bytes_sent=h.num_kv_bytes_sent, **what)
        return ReplicaStatus(s.replica_id, s.stage, False, num_in_flight=s.num_in_flight, state=h.state.value,
                             num_restarts=h.num_restarts, last_error=h.last_error, **what)

    def lost_channel(self, rid: str) -> None:
        """The replica's request channel broke: out of the router until it is back."""
        if rid in self._health:
            self._take_out(rid, "its request channel broke")

    # ---- watching ----------------------------------------------------------
    async def _watch(self, rid: str) -> None:
        while True:
            await asyncio.sleep(self.load_interval_s)
            try:
                if self._health[rid].state in (ReplicaState.SERVING, ReplicaState.STALLED):
                    await self._poll(rid)
            except asyncio.CancelledError:
                raise
            except Exception:  # keep watching whatever one round hit
                log.exception("replica %s: load poll failed", rid)

    async def _poll(self, rid: str) -> None:
        h = self._health[rid]
        handle = self.handle(rid)
        try:
            load = await within(_awaitable(handle.load.remote()), self.config.heartbeat_timeout_s)
        except asyncio.TimeoutError:
            now = time.monotonic()
            h.silent_since = h.silent_since or now
            if h.state is ReplicaState.SERVING:
                self._take_out(rid, f"missed its heartbeat: no load report for "
                                    f"{self.config.heartbeat_timeout_s:g}s", ReplicaState.STALLED)
            elif now - h.silent_since >= self.config.replace_after_s:
                self._replace(rid, f"stalled for {now - h.silent_since:.0f}s")
            return
        except Exception as e:  # Ray: the actor died
            self._replace(rid, f"{type(e).__name__}: {_first_line(e)}")
            return
        h.silent_since = None
        h.expert_load = tuple(getattr(load, "expert_load", ()))
        h.num_prompt_tokens_computed = getattr(load, "num_prompt_tokens_computed", 0)
        h.num_kv_bytes_sent = getattr(load, "num_kv_bytes_sent", 0)
        h.runs = dict(quantization=load.quantization, kernel_isa=load.kernel_isa,
                      pipeline_parallel_size=getattr(load, "pipeline_parallel_size", 1))
        if not load.is_alive:
            self._replace(rid, "its stage loop died" + (f": {_first_line(load.error)}" if load.error else ""))
            return
        hashes = frozenset()
        if self.router.config.policy == "prefix_aware" and h.stage is not Stage.DECODE:
            try:
                hashes = await within(_awaitable(handle.cached_block_hashes.remote()),
                                                self.config.heartbeat_timeout_s)
            except Exception:
                pass
        self.router.report_load(ReplicaLoad(rid, h.stage, load.num_queued_prefill_tokens, load.num_running_seqs,
                                            load.num_free_blocks, load.num_total_blocks, hashes, time.monotonic()))
        if h.state is ReplicaState.STALLED or not self.channels.is_connected(rid):
            if rid not in self._reconnecting:  # it answers again: back once its channel is
                self._reconnecting.add(rid)
                asyncio.create_task(self._rejoin(rid))

    async def _rejoin(self, rid: str) -> None:
        try:
            await self._connect(rid)
            self._health[rid].state = ReplicaState.SERVING
            self.router.mark_alive(rid)
            log.warning("replica %s: serving again", rid)
        except Exception as e:
            log.warning("replica %s: request channel still down: %s", rid, e)
        finally:
            self._reconnecting.discard(rid)

    async def _connect(self, rid: str) -> None:
        handle = self.handle(rid)
        await _awaitable(handle.connect_channel.remote(self.channels.address, self.channels.secret))
        await self.channels.wait_connected([rid], self.connect_timeout_s)
        self._health[rid].rank_pids = tuple(await _awaitable(handle.rank_pids.remote()))

    def _take_out(self, rid: str, why: str, state: ReplicaState | None = None) -> None:
        h = self._health[rid]
        if state is not None and h.state is ReplicaState.SERVING:
            h.state = state
        for r in self.router.replicas():
            if r.replica_id == rid and r.is_alive:
                log.error("replica %s is out of the router: %s", rid, why)
                self.router.mark_dead(rid, returning=True)  # until it rejoins, is replaced or is given up on
                h.last_error = why
        self.channels.drop(rid)  # its requests hear Lost now, not when (if ever) the socket notices

    # ---- replacing ---------------------------------------------------------
    def _replace(self, rid: str, why: str) -> None:
        h = self._health[rid]
        if h.state in (ReplicaState.RESTARTING, ReplicaState.FAILED):
            return
        self._take_out(rid, why)
        h.last_error = why
        if self.respawn is None or h.num_restarts >= self.config.restart_budget:
            self._give_up(rid)
            return
        h.state = ReplicaState.RESTARTING
        self._tasks.append(asyncio.create_task(self._restart(rid)))

    async def _restart(self, rid: str) -> None:
        h = self._health[rid]
        loop = asyncio.get_running_loop()
        while h.num_restarts < self.config.restart_budget:
            h.num_restarts += 1
            await asyncio.sleep(self.config.restart_backoff_s * 2 ** (h.num_restarts - 1))
            log.warning("replica %s: starting replacement %d (%s)", rid, h.num_restarts, h.last_error)
            try:
                handle = await loop.run_in_executor(None, self.respawn, rid, self.handle(rid), h.num_restarts)
                self.handles[rid] = (h.stage, handle)
                await within(_awaitable(handle.load.remote()), self.config.ready_timeout_s)
                await self._connect(rid)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                h.last_error = f"replacement {h.num_restarts} failed: {type(e).__name__}: {_first_line(e)}"
                log.error("replica %s: %s", rid, h.last_error)
                continue
            h.state, h.silent_since = ReplicaState.SERVING, None
            self.router.mark_alive(rid)
            log.warning("replica %s: replacement %d serving", rid, h.num_restarts)
            return
        self._give_up(rid)

    def _give_up(self, rid: str) -> None:
        h = self._health[rid]
        h.state = ReplicaState.FAILED
        log.error("replica %s failed for good after %d restarts: %s", rid, h.num_restarts, h.last_error)
        self.router.mark_dead(rid)  # not coming back: requests waiting for it fail if it was its stage's last
        if self.on_failed is not None:
            try:
                self.on_failed(rid, h.last_error)
            except Exception:
                log.exception("replica %s: reporting its failure failed", rid)


def _awaitable(ref):
    """A Ray ObjectRef as an asyncio future (anything else awaitable as is)."""
    return asyncio.wrap_future(ref.future()) if hasattr(ref, "future") else ref


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0][:300]
