"""Start both frontends (gRPC and OpenAI HTTP) over one backend, in one event loop.

They share the backend, the API keys and one `ServingMetrics`, so a request
counts the same whichever door it came in by, and ``/metrics`` on the HTTP
port shows both.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

from cluster.backend import Backend
from cluster.grpc_frontend import GrpcFrontend
from cluster.http_frontend import HttpFrontend
from cluster.metrics import ServingMetrics
from cluster.configs import FrontendConfig


@dataclass
class Frontends:
    """The running frontends: bound ports, the shared metrics, and `stop`."""

    grpc: GrpcFrontend
    http: HttpFrontend | None  # None when the config has no http_port
    metrics: ServingMetrics

    @property
    def grpc_port(self) -> int:
        return self.grpc.port

    @property
    def http_port(self) -> int | None:
        return None if self.http is None else self.http.port

    async def stop(self, grace: float | None = 5.0) -> None:
        """Stop both; running requests get ``grace`` seconds, then are aborted."""
        stopping = [self.grpc.stop(grace)] + ([self.http.stop(grace)] if self.http is not None else [])
        await asyncio.gather(*stopping)

    async def wait_for_termination(self) -> None:
        await self.grpc.wait_for_termination()


async def serve_frontends(backend: Backend, config: FrontendConfig,
                          metrics: ServingMetrics | None = None) -> Frontends:
    """Bind and start gRPC on ``config.grpc_port`` and, unless it is None, HTTP on ``config.http_port``.

    Port 0 binds any free port; the returned `Frontends` has the bound ones.
    If the HTTP port cannot be bound, the gRPC server is stopped again and
    the error raised.
    """
    metrics = metrics if metrics is not None else ServingMetrics(backend.model_name)
    grpc_frontend = GrpcFrontend(backend, config, metrics)
    await grpc_frontend.start()
    http_frontend = None
    if config.http_port is not None:
        http_frontend = HttpFrontend(backend, config, metrics)
        try:
            await http_frontend.start()
        except BaseException:
            await grpc_frontend.stop(0)
            raise
    return Frontends(grpc_frontend, http_frontend, metrics)
