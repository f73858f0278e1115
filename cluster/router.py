"""Places each request on a (prefill, decode) replica pair, or one colocated replica.

Plain Python: no Ray, gRPC or torch. Life of a request in the router:

1. ``acquire(request)``: if every replica of a stage the request needs is at
   capacity (``max_inflight_per_replica`` requests placed and not released),
   or earlier requests are already waiting, the request waits in a bounded
   FIFO admission queue; past ``max_queue`` waiters or ``queue_timeout_s`` it
   is refused with `OverloadedError`. A stage whose every replica is down
   but one of them is coming back (restarting, or stalled and not yet given
   up on) is at no capacity: its requests wait in the same queue for the
   replacement, within the same bound. A stage with none coming back fails
   them with `NoReplicaError` at once.
2. The policy picks a replica per stage among the live ones with capacity.
   The placement is counted against the replica at once (optimistic
   accounting), so a burst between two load reports spreads out.
3. ``release(placement)`` when the request ends, however it ends. It frees
   capacity and hands it to the head of the queue.

Replicas report `ReplicaLoad` every so often; a report replaces the
optimistic adjustments made before it arrived.
"""
from __future__ import annotations

import asyncio
import itertools
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from cluster.types import GenerateRequest, NoReplicaError, OverloadedError, ReplicaStatus, Stage
from engine.block_pool import compute_block_hashes

POLICIES = ("round_robin", "least_loaded", "power_of_two", "prefix_aware")


@dataclass(frozen=True)
class RouterConfig:
    mode: str = "disaggregated"  # or "colocated"
    policy: str = "least_loaded"
    max_queue: int = 256
    queue_timeout_s: float = 30.0
    max_inflight_per_replica: int | dict[Stage, int] = 64
    block_size: int = 16  # for prefix_aware's block hashes; must match the replicas'
    prefix_load_weight: float = 0.5  # prefix_aware: a queued token costs this many uncached prompt tokens
    seed: int = 0

    def capacity(self, stage: Stage) -> int:
        m = self.max_inflight_per_replica
        return m[stage] if isinstance(m, dict) else m

    def stages(self) -> tuple[Stage, ...]:
        return (Stage.COLOCATED,) if self.mode == "colocated" else (Stage.PREFILL, Stage.DECODE)


@dataclass(frozen=True)
class ReplicaLoad:
    """A replica's report of its own load."""

    replica_id: str
    stage: Stage
    num_queued_prefill_tokens: int = 0
    num_running_seqs: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    cached_block_hashes: frozenset[int] = frozenset()  # prefix-cache contents (prefill, colocated)
    timestamp: float = 0.0  # the replica's clock; older reports than the last are ignored


@dataclass
class _Pending:
    """A placement made since the replica's last report (not yet in its numbers)."""

    num_tokens: int
    num_blocks: int
    block_hashes: tuple[int, ...]


@dataclass
class Replica:
    """The router's view of one replica: its last report plus optimistic adjustments."""

    replica_id: str
    stage: Stage
    capacity: int
    load: ReplicaLoad
    is_alive: bool = True
    returning: bool = False  # down, but expected back (being replaced, or stalled): requests wait for it
    num_in_flight: int = 0  # placed and not released (exact)
    pending: list[_Pending] = field(default_factory=list)

    @property
    def queued_tokens(self) -> int:
        return self.load.num_queued_prefill_tokens + sum(p.num_tokens for p in self.pending)

    @property
    def free_blocks(self) -> int:
        return self.load.num_free_blocks - sum(p.num_blocks for p in self.pending)

    @property
    def running_seqs(self) -> int:
        return self.load.num_running_seqs + len(self.pending)

    @property
    def has_capacity(self) -> bool:
        return self.is_alive and self.num_in_flight < self.capacity

    def cached_prefix_blocks(self, block_hashes: Sequence[int]) -> int:
        """How many leading blocks of a prompt this replica has (or is about to have) cached."""
        expected = set(itertools.chain.from_iterable(p.block_hashes for p in self.pending))
        n = 0
        for h in block_hashes:  # chained hashes: stop at the first miss
            if h not in self.load.cached_block_hashes and h not in expected:
                break
            n += 1
        return n


@dataclass(frozen=True)
class Placement:
    """Where a request runs. ``prefill_replica`` is None when the decode (or
    colocated) replica also runs the prefill."""

    request_id: str
    decode_replica: str
    prefill_replica: str | None = None
    seq: int = 0  # the router's handle; release() takes the whole placement

    @property
    def replica_ids(self) -> tuple[str, ...]:
        return (self.decode_replica,) if self.prefill_replica is None else (self.prefill_replica, self.decode_replica)


# ---- policies ---------------------------------------------------------------
# A policy picks one replica among live candidates that have capacity.

def load_key(r: Replica) -> tuple:
    """Smaller is less loaded. Prefill: pending tokens. Decode: free blocks, then running."""
    if r.stage is Stage.PREFILL:
        return (r.queued_tokens, r.num_in_flight)
    if r.stage is Stage.DECODE:
        return (-r.free_blocks, r.running_seqs, r.num_in_flight)
    return (r.queued_tokens, -r.free_blocks, r.running_seqs, r.num_in_flight)


class RoundRobin:
    def __init__(self, config: RouterConfig):
        self._next: dict[Stage, int] = {}

    def choose(self, candidates: list[Replica], request: "_Routed") -> Replica:
        i = self._next.get(candidates[0].stage, 0)
        self._next[candidates[0].stage] = i + 1
        return candidates[i % len(candidates)]


class LeastLoaded:
    def __init__(self, config: RouterConfig):
        pass

    def choose(self, candidates: list[Replica], request: "_Routed") -> Replica:
        return min(candidates, key=load_key)


class PowerOfTwo:
    """Sample two candidates at random (seeded) and take the less loaded."""

    def __init__(self, config: RouterConfig):
        self._rng = random.Random(config.seed)

    def choose(self, candidates: list[Replica], request: "_Routed") -> Replica:
        if len(candidates) == 1:
            return candidates[0]
        a, b = self._rng.sample(candidates, 2)
        return a if load_key(a) <= load_key(b) else b


class PrefixAware:
    """Prefill (and colocated) replicas: weigh the prompt's cached prefix against load.

    cost = (prompt tokens - cached prefix tokens) + w * queued tokens, with
    w = ``prefix_load_weight``. With w < 1 a replica that has the prefix keeps
    getting it (so a burst sharing a new prefix computes it once) until its
    queue outweighs the saving. Decode replicas hold no prefix useful to the
    prompt, so they are picked least-loaded.
    """

    def __init__(self, config: RouterConfig):
        self.block_size = config.block_size
        self.load_weight = config.prefix_load_weight

    def choose(self, candidates: list[Replica], request: "_Routed") -> Replica:
        if candidates[0].stage is Stage.DECODE:
            return min(candidates, key=load_key)
        hashes = request.block_hashes(self.block_size)

        def cost(r: Replica) -> tuple:
            cached = r.cached_prefix_blocks(hashes) * self.block_size
            return (request.num_tokens - cached + self.load_weight * r.queued_tokens, load_key(r))

        return min(candidates, key=cost)


_POLICY_CLASSES = {"round_robin": RoundRobin, "least_loaded": LeastLoaded,
                   "power_of_two": PowerOfTwo, "prefix_aware": PrefixAware}


class _Routed:
    """A request as the policies see it (block hashes computed once, on demand)."""

    def __init__(self, request: GenerateRequest):
        self.request = request
        self.num_tokens = request.num_prompt_tokens
        self._hashes: tuple[int, ...] | None = None

    def block_hashes(self, block_size: int) -> tuple[int, ...]:
        if self._hashes is None:
            self._hashes = tuple(compute_block_hashes(self.request.prompt_token_ids, block_size))
        return self._hashes


@dataclass
class _Waiter:
    routed: _Routed
    future: asyncio.Future


# ---- the router ---------------------------------------------------------------

class Router:
    """Not thread-safe: call it from one event loop (the frontend's)."""

    def __init__(self, config: RouterConfig):
        if config.policy not in _POLICY_CLASSES:
            raise ValueError(f"router.policy: must be one of {POLICIES}, got {config.policy!r}")
        self.config = config
        self.policy = _POLICY_CLASSES[config.policy](config)
        self._replicas: dict[str, Replica] = {}
        self._active: dict[int, Placement] = {}
        self._waiters: deque[_Waiter] = deque()
        self._seq = itertools.count(1)

    # ---- replicas ----------------------------------------------------------
    def add_replica(self, replica_id: str, stage: Stage, capacity: int | None = None) -> None:
        if replica_id in self._replicas:
            raise ValueError(f"replica {replica_id!r} is already registered")
        if stage not in self.config.stages():
            raise ValueError(f"replica {replica_id!r}: stage {stage.value} is not used in mode {self.config.mode}")
        cap = capacity if capacity is not None else self.config.capacity(stage)
        self._replicas[replica_id] = Replica(replica_id, stage, cap, ReplicaLoad(replica_id, stage))
        self._grant_waiters()

    def remove_replica(self, replica_id: str) -> None:
        """Forget a replica. Placements on it stay active until released."""
        self._replicas.pop(replica_id)
        self._fail_waiters_if_a_stage_is_gone()

    def mark_dead(self, replica_id: str, returning: bool = False) -> None:
        """Stop placing on a replica. ``returning``: it is expected back (`mark_alive`), and while it is
        its stage's last, requests wait for it in the admission queue; otherwise (or once it is marked
        dead again without ``returning``) waiters fail with NoReplicaError if it was a stage's last."""
        r = self._replicas[replica_id]
        r.is_alive, r.returning = False, returning
        self._fail_waiters_if_a_stage_is_gone()

    def mark_alive(self, replica_id: str) -> None:
        r = self._replicas[replica_id]
        r.is_alive, r.returning = True, False
        self._grant_waiters()

    def report_load(self, load: ReplicaLoad) -> None:
        r = self._replicas.get(load.replica_id)
        if r is None:
            raise KeyError(f"load report from unknown replica {load.replica_id!r}")
        if load.stage is not r.stage:
            raise ValueError(f"replica {load.replica_id!r} reported stage {load.stage.value}, "
                             f"registered as {r.stage.value}")
        if load.timestamp < r.load.timestamp:
            return  # out of order
        r.load = load
        r.pending.clear()
        self._grant_waiters()

    def replicas(self) -> list[Replica]:
        return list(self._replicas.values())

    def replica_statuses(self) -> tuple[ReplicaStatus, ...]:
        """Each replica's last report and in-flight count, for `Backend.status`."""
        return tuple(ReplicaStatus(r.replica_id, r.stage, r.is_alive, r.load.num_running_seqs,
                                   r.load.num_queued_prefill_tokens, r.num_in_flight, r.load.num_free_blocks,
                                   r.load.num_total_blocks) for r in self._replicas.values())

    @property
    def num_waiting(self) -> int:
        return len(self._waiters)

    @property
    def num_active(self) -> int:
        return len(self._active)

    # ---- placement ---------------------------------------------------------
    def try_place(self, request: GenerateRequest) -> Placement | None:
        """Place now if every needed stage has a replica with capacity, else None.

        Does not look at the queue; `acquire` is the fair entry point.
        """
        self._check_live()
        return self._place(_Routed(request))

    async def acquire(self, request: GenerateRequest) -> Placement:
        """Place the request, waiting in the admission queue if needed.

        Raises NoReplicaError when a needed stage has no live replica and none
        coming back (or the one coming back is not back within the queue's
        timeout), and OverloadedError when the queue is full or the wait times out.
        """
        self._check_live()
        routed = _Routed(request)
        if not self._waiters:
            placement = self._place(routed)
            if placement is not None:
                return placement
        if len(self._waiters) >= self.config.max_queue:
            raise OverloadedError(f"all replicas are busy and {len(self._waiters)} requests are "
                                  f"already waiting (router.max_queue={self.config.max_queue})")
        loop = asyncio.get_running_loop()
        waiter = _Waiter(routed, loop.create_future())
        self._waiters.append(waiter)
        timer = loop.call_later(self.config.queue_timeout_s, self._expire, waiter)
        try:
            return await waiter.future
        except asyncio.CancelledError:
            if waiter.future.done() and not waiter.future.cancelled():
                self.release(waiter.future.result())  # granted in the tick we were cancelled
            elif waiter in self._waiters:
                self._waiters.remove(waiter)
            raise
        finally:
            timer.cancel()

    def place_beside(self, request: GenerateRequest, other: Placement) -> Placement | None:
        """Place ``request``, a sibling choice of ``other``'s (n > 1), on ``other``'s decode (or colocated)
        replica alone, past its capacity: it forks there from the sibling's prompt, whose KV comes once
        (`decode.stage`). None if that replica is no longer alive."""
        r = self._replicas.get(other.decode_replica)
        if r is None or not r.is_alive:
            return None
        return self._take(_Routed(request), {r.stage: r})

    def release(self, placement: Placement) -> None:
        """Give back a placement's capacity. Releasing twice is an error."""
        if self._active.pop(placement.seq, None) is None:
            raise ValueError(f"placement of request {placement.request_id!r} was already released")
        for rid in placement.replica_ids:
            r = self._replicas.get(rid)
            if r is not None:
                r.num_in_flight -= 1
        self._grant_waiters()

    # ---- internals ---------------------------------------------------------
    def _check_live(self) -> None:
        for stage in self.config.stages():
            if not any((r.is_alive or r.returning) and r.stage is stage for r in self._replicas.values()):
                raise NoReplicaError(f"no live {stage.value} replica")

    def _down_stages(self) -> str | None:
        """Why a waiter may be waiting for want of live replicas: the stages with none alive, and the
        replicas of theirs that are expected back; None if every stage has a live replica."""
        down = []
        for stage in self.config.stages():
            mine = [r for r in self._replicas.values() if r.stage is stage]
            if not any(r.is_alive for r in mine):
                back = [r.replica_id for r in mine if r.returning]
                being = "is" if len(back) == 1 else "are"
                down.append(f"no live {stage.value} replica" + (f" ({', '.join(back)} {being} being replaced or "
                                                                 f"recovering)" if back else ""))
        return "; ".join(down) or None

    def _place(self, routed: _Routed) -> Placement | None:
        chosen: dict[Stage, Replica] = {}
        for stage in self.config.stages():
            candidates = [r for r in self._replicas.values() if r.stage is stage and r.has_capacity]
            if not candidates:
                return None
            chosen[stage] = self.policy.choose(candidates, routed)
        return self._take(routed, chosen)

    def _take(self, routed: _Routed, chosen: dict[Stage, Replica]) -> Placement:
        n = routed.num_tokens
        hashes = routed.block_hashes(self.config.block_size) if self.config.policy == "prefix_aware" else ()
        for stage, r in chosen.items():
            r.num_in_flight += 1
            num_blocks = -(-n // self.config.block_size) if stage is not Stage.PREFILL else 0
            num_tokens = 0 if stage is Stage.DECODE else n - r.cached_prefix_blocks(hashes) * self.config.block_size
            r.pending.append(_Pending(num_tokens, num_blocks, hashes if stage is not Stage.DECODE else ()))
        if Stage.PREFILL not in chosen:  # colocated, or a fork on a decode replica
            (r,) = chosen.values()
            placement = Placement(routed.request.request_id, r.replica_id, None, next(self._seq))
        else:
            placement = Placement(routed.request.request_id, chosen[Stage.DECODE].replica_id,
                                  chosen[Stage.PREFILL].replica_id, next(self._seq))
        self._active[placement.seq] = placement
        return placement

    def _fail_waiters_if_a_stage_is_gone(self) -> None:
        try:
            self._check_live()
        except NoReplicaError as e:
            while self._waiters:
                waiter = self._waiters.popleft()
                if not waiter.future.done():
                    waiter.future.set_exception(NoReplicaError(str(e)))

    def _expire(self, waiter: _Waiter) -> None:
        if waiter.future.done():
            return
        self._waiters.remove(waiter)
        down = self._down_stages()
        if down is not None:  # not busy: down, and not back in time
            waiter.future.set_exception(NoReplicaError(
                f"{down}, and none came back within {self.config.queue_timeout_s}s (router.queue_timeout_s)"))
            return
        waiter.future.set_exception(OverloadedError(
            f"no replica became free within {self.config.queue_timeout_s}s (router.queue_timeout_s)"))

    def _grant_waiters(self) -> None:
        while self._waiters:
            head = self._waiters[0]
            if head.future.done():  # gave up already
                self._waiters.popleft()
                continue
            placement = self._place(head.routed)
            if placement is None:
                return
            self._waiters.popleft()
            head.future.set_result(placement)
