"""Several frontend processes for one deployment (spec ``frontend.replicas: N``).

With one frontend (the default) the `kvrelay serve` process serves. With N > 1
it starts N frontend actors on its own node instead, each a whole frontend:
gRPC and HTTP on the spec's ports (shared with SO_REUSEPORT, so the kernel
spreads connections over them) or on ports of its own (``reuse_port: false``:
frontend i on grpc_port + i and http_port + i), its own request channel that
every replica dials, and its own router view built from the replicas' load
reports. Losing one frontend loses only the requests it held: the others go
on, the replicas abort what came by its channel (so its blocks come back),
and Ray restarts it.

The `kvrelay serve` process stays the deployment's controller: it owns the
replica actors (so they go when it goes: nothing is left behind), watches
them and replaces the ones that fail, exactly as with one frontend. What
each replica's current actor is lives in the `ReplicaDirectory`, a small
actor the controller writes on every replacement. A frontend that sees a
replica fail waits for the directory to name its replacement (it never
starts one itself), and a frontend that Ray restarts reads the directory to
find the running replicas instead of starting new ones.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, replace

from cluster.types import Stage

log = logging.getLogger(__name__)

DIRECTORY_POLL_S = 0.2


@dataclass
class DirectoryEntry:
    stage: Stage
    handle: object  # the replica's current actor
    generation: int = 0  # how many times the controller replaced it
    is_failed: bool = False  # the controller gave up on it (restart budget spent)
    last_error: str = ""


class ReplicaDirectory:
    """Replica id -> its current actor, as the controller last set it. A Ray actor (no CPU of its own)."""

    def __init__(self, entries: dict[str, DirectoryEntry]):
        self.entries = dict(entries)

    def publish(self, rid: str, handle, generation: int) -> None:
        self.entries[rid] = replace(self.entries[rid], handle=handle, generation=generation, is_failed=False)

    def fail(self, rid: str, error: str) -> None:
        self.entries[rid] = replace(self.entries[rid], is_failed=True, last_error=error)

    def snapshot(self) -> dict[str, DirectoryEntry]:
        return dict(self.entries)

    def get(self, rid: str) -> DirectoryEntry:
        return self.entries[rid]


def follow_directory(directory, timeout_s: float):
    """A `cluster.replicas.Respawn` for a frontend: wait for the controller to
    name a replacement of ``rid`` newer than ``old`` in ``directory``; raise
    if the controller gave up on it or none came within ``timeout_s``."""
    import ray

    def follow(rid: str, old, restart: int):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            entry = ray.get(directory.get.remote(rid), timeout=timeout_s)
            if entry.is_failed:
                raise RuntimeError(f"the controller gave up on {rid}: {entry.last_error}")
            if not _same_actor(entry.handle, old):
                return entry.handle
            time.sleep(DIRECTORY_POLL_S)
        raise TimeoutError(f"the controller named no replacement for {rid} within {timeout_s:g}s")

    return follow


def _same_actor(a, b) -> bool:
    return a is b or getattr(a, "_actor_id", a) == getattr(b, "_actor_id", b)


def frontend_ports(config) -> list[tuple[int, int | None]]:
    """The (gRPC, HTTP) ports each frontend binds: the spec's for all of them
    with reuse_port, else the spec's plus the frontend's index. A port 0 is
    resolved here, once, to a free port, so a frontend that Ray restarts
    binds the ports it had (its clients find it where it was)."""
    def resolve(port: int | None) -> int | None:
        return _free_port(config.host) if port == 0 else port

    if config.reuse_port:
        return [(resolve(config.grpc_port), resolve(config.http_port))] * config.replicas
    plus = lambda p, i: p if not p else p + i  # noqa: E731
    return [(resolve(plus(config.grpc_port, i)),
             None if config.http_port is None else resolve(plus(config.http_port, i))) for i in range(config.replicas)]


def _free_port(host: str) -> int:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class FrontendReplica:
    """One frontend process of a deployment (a Ray actor): a backend over the
    replicas the directory names, and the gRPC and HTTP frontends over it, on
    an event loop of its own thread. Ray restarts it if it dies; a restarted
    one finds the replicas in the directory."""

    def __init__(self, index: int, config, model_dir: str, directory, is_joined: bool,
                 ports: tuple[int, int | None]):
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        from engine.serving.stage_loop import normal_priority

        normal_priority()  # Ray starts its workers at niceness 15; a frontend must not lag the replicas
        self.index = index
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._ports: tuple[int, int | None] | None = None
        self._loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, args=(config, model_dir, directory, is_joined, ports),
                                        name=f"frontend-{index}", daemon=True)
        self._thread.start()

    def ready(self, timeout_s: float = 300.0) -> tuple[int, int | None]:
        """The bound (gRPC, HTTP) ports once serving; raises the start's error."""
        if not self._ready.wait(timeout_s):
            raise TimeoutError(f"frontend {self.index} not serving after {timeout_s:g}s")
        if self._error is not None:
            raise self._error
        return self._ports

    def pid(self) -> int:
        import os

        return os.getpid()

    def stop(self, grace_s: float = 5.0) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(grace_s + 10)

    def _run(self, config, model_dir, directory, is_joined, ports) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._serve(config, model_dir, directory, is_joined, ports))

    async def _serve(self, config, model_dir, directory, is_joined, ports) -> None:
        import ray

        from cluster.frontends import serve_frontends
        from cluster.launcher import build_backend

        self._stop = asyncio.Event()
        backend = frontends = None
        try:
            entries = await asyncio.wrap_future(directory.snapshot.remote().future())
            actors = {rid: (e.stage, e.handle) for rid, e in entries.items()}
            follow = follow_directory(directory, config.health.ready_timeout_s)
            backend = await build_backend(config, model_dir, actors, is_joined, respawn=follow,
                                          tolerate_missing=True, node=ray.util.get_node_ip_address())
            fc = replace(config.frontend, grpc_port=ports[0], http_port=ports[1])
            frontends = await serve_frontends(backend, fc)
            self._ports = (frontends.grpc_port, frontends.http_port)
            log.info("frontend %d serving: gRPC %d, HTTP %s", self.index, *self._ports)
        except BaseException as e:  # noqa: BLE001 - handed to ready()
            self._error = RuntimeError(f"frontend {self.index} failed to start: {type(e).__name__}: {e}")
        self._ready.set()
        if self._error is None:
            await self._stop.wait()
        if frontends is not None:
            await frontends.stop(grace=5.0)
        if backend is not None:
            await backend.stop()
