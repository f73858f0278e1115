"""Whether the deployment can serve: one rule for HTTP ``/health`` and gRPC ``grpc.health.v1``.

The rule (`unhealthy_reason`): every stage the deployment runs has at least
one live replica, and the backend answered ``status()`` in time. HTTP asks
it per ``GET /health``. gRPC health (`GrpcHealth`) polls it every
``interval_s`` and sets every served service (``""`` and
``kvrelay.v1.KVRelay``) to SERVING or NOT_SERVING, so ``Check`` answers
what ``/health`` would and ``Watch`` streams each change (Kubernetes gRPC
probes read these).
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

from grpc_health.v1 import health, health_pb2

from cluster.backend import Backend
from cluster.types import ClusterStatus
from engine.serving.timeouts import cancel_and_wait, within

log = logging.getLogger(__name__)

STATUS_TIMEOUT_S = 5.0  # a backend that takes longer to say how it is, is not healthy
STOP_TIMEOUT_S = 5.0  # the most `GrpcHealth.stop` waits for its follower to end


def unhealthy_reason(status: ClusterStatus) -> str | None:
    """None when every stage has a live replica; else why the deployment cannot serve."""
    stages = {r.stage for r in status.replicas}
    if not stages:
        return "no replicas"
    dead = sorted(s.value for s in stages if not any(r.is_alive for r in status.replicas if r.stage is s))
    return f"no live replica of stage {', '.join(dead)}" if dead else None


async def check(backend: Backend, timeout_s: float = STATUS_TIMEOUT_S) -> str | None:
    """`unhealthy_reason` of the backend's status now; a status that fails or is late is a reason too."""
    try:
        status = await within(backend.status(), timeout_s)
    except Exception as e:
        return f"status failed: {type(e).__name__}: {e}"
    return unhealthy_reason(status)


class GrpcHealth:
    """grpc.health.v1 for ``services``, following `check` every ``interval_s`` seconds."""

    def __init__(self, backend: Backend, services: Iterable[str], interval_s: float = 1.0):
        self.backend = backend
        self.services = tuple(services)
        self.interval_s = interval_s
        self.servicer = health.aio.HealthServicer()
        self.reason: str | None = "not checked yet"
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        """Check once (so the first probe is answered truly), then keep following."""
        await self.poll_once()
        self._task = asyncio.create_task(self._follow())

    async def poll_once(self) -> None:
        reason = await check(self.backend, min(STATUS_TIMEOUT_S, max(self.interval_s, 1.0)))
        if reason != self.reason:
            if reason is None:
                log.info("gRPC health: SERVING")
            else:
                log.warning("gRPC health: NOT_SERVING (%s)", reason)
        self.reason = reason
        serving = health_pb2.HealthCheckResponse.SERVING if reason is None else \
            health_pb2.HealthCheckResponse.NOT_SERVING
        for name in self.services:
            await self.servicer.set(name, serving)

    async def _follow(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.poll_once()
            except Exception:  # keep following whatever one round hit
                log.exception("gRPC health poll failed")

    async def stop(self) -> None:
        """Stop following and report NOT_SERVING from now on (a server going away)."""
        if self._task is not None:
            await cancel_and_wait([self._task], STOP_TIMEOUT_S, "gRPC health follower")
            self._task = None
        await self.servicer.enter_graceful_shutdown()
