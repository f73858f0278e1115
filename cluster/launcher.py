"""Starts a kvrelay deployment: Ray actors for each stage's replicas, the
router, and the frontends. Ray appears here and nowhere else: the stages are
plain classes that this module hosts.

`kvrelay serve SPEC` starts a local Ray instance when no cluster address is
given (spec `ray.address` or RAY_ADDRESS); under `ray job submit` it joins
the running cluster.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import os
import secrets
import signal
import sys
import threading
import time

from cluster.frontends import Frontends, serve_frontends
from cluster.ray_backend import RayBackend
from cluster.ray_join import init_ray
from cluster.router import Router
from cluster.configs import ClusterConfig, StageConfig
from cluster.spec import Spec, split_spec
from cluster.spec_errors import SpecError
from cluster.spec_tp import check_fits_cluster, check_fits_model
from cluster.types import Stage
from engine.serving.timeouts import within

log = logging.getLogger(__name__)

# Threaded actors: calls (reserve, stream, abort, load) arrive on Ray's
# threads while the stage's own loop thread runs the engine.
ACTOR_MAX_CONCURRENCY = 1000


class StartCancelled(RuntimeError):
    """`Cluster.start_cancelled` was set while the replicas loaded (`kvrelay serve` got SIGINT/SIGTERM)."""


def _resources(res: dict) -> str:
    """Ray resources as `CPU 1, GPU 0`: the ones a spec's `resources` name (no node or memory keys)."""
    shown = {k: v for k, v in res.items() if not k.startswith(("node:", "memory", "object_store_memory"))}
    return ", ".join(f"{k} {v:g}" for k, v in sorted(shown.items())) or "none"


def _stage_class(stage: Stage):
    if stage is Stage.PREFILL:
        from prefill.stage import PrefillStage
        return PrefillStage
    from decode.stage import DecodeStage
    return DecodeStage


class Cluster:
    """One deployment: actors + router + backend (+ frontends when served)."""

    def __init__(self, config: ClusterConfig):
        self.config = config
        self.start_cancelled = threading.Event()  # set (from any thread) to stop a start part-way
        self.actors: dict[str, tuple[Stage, object]] = {}
        self.placement_groups: dict[str, object] = {}  # replica id -> its placement group (tensor-parallel ones)
        self.backend: RayBackend | None = None
        self.frontends: Frontends | None = None
        self._started_ray = False
        self._is_joined = False  # a Ray cluster that may span hosts (set by start_actors)
        self._startup_profile: asyncio.Task | None = None
        self.name = f"kvrelay-{secrets.token_hex(3)}"  # actor names: <name>-<replica id>
        self.directory = None  # with several frontends: the ReplicaDirectory actor
        self.progress = lambda line: log.info("%s", line)  # startup progress; `kvrelay serve` prints it

    # ---- actors ------------------------------------------------------------
    def start_actors(self, ready_timeout_s: float = 300.0) -> None:
        import ray

        from engine.weights import read_config, resolve_model

        cfg = self.config
        # Convert a GGUF once, here, so replicas don't race to do it; a TP that does not split the
        # model is refused before Ray starts.
        t0 = time.monotonic()
        self.progress(f"preparing the model {cfg.model or 'SmolLM2-135M-Instruct'} "
                      "(a GGUF is converted once, then cached)")
        self.model_dir = str(resolve_model(cfg.model))
        self.progress(f"model ready in {time.monotonic() - t0:.1f}s: {self.model_dir}")
        check_fits_model(cfg.stages, read_config(self.model_dir))
        if not ray.is_initialized():
            address = cfg.ray_address or os.environ.get("RAY_ADDRESS")
            self.progress(f"joining the Ray cluster at {address}" if address else "starting a local Ray instance")
            init_ray(cfg.ray_address, cfg.ray_namespace)  # a failure names the auth token setting
            self._started_ray = True
        # a joined cluster may span hosts: receivers bind where the spec's
        # network section says (default: their node's own address)
        self._is_joined = bool(cfg.ray_address or os.environ.get("RAY_ADDRESS"))
        try:  # a replica the cluster cannot hold would wait for resources until ready_timeout_s
            check_fits_cluster(cfg.stages, ray.cluster_resources())
        except SpecError as e:
            if not self._is_joined:
                raise
            log.warning("%s\n(a joined cluster may still grow to fit: waiting up to %gs)", e, ready_timeout_s)
        transfer = cfg.transfer
        if transfer.sender.secret is None:
            transfer = transfer.with_secret(secrets.token_hex(16))
        receiver = cfg.network.receiver_config(transfer.receiver, self._is_joined)
        self._transfer_args = {Stage.PREFILL: transfer.sender, Stage.DECODE: receiver, Stage.COLOCATED: None}
        for stage, sc in cfg.stages.items():
            for i in range(sc.num_replicas):
                rid = f"{stage.value}-{i}"
                self.actors[rid] = (stage, self._spawn(rid, stage))
        self.progress(f"loading {_replicas(len(self.actors))}: {', '.join(self.actors)}")
        t0 = time.monotonic()
        refs = {a.load.remote(): rid for rid, (_, a) in self.actors.items()}
        pending = list(refs)
        while pending:
            left = t0 + ready_timeout_s - time.monotonic()
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, min(left, 0.5)))
            if not ready and self.start_cancelled.is_set():
                raise StartCancelled(f"stopped while loading {', '.join(refs[r] for r in pending)}")
            if not ready and left > 0.5:
                continue
            if not ready:
                raise TimeoutError(f"replica(s) {', '.join(refs[r] for r in pending)} not ready after "
                                   f"{ready_timeout_s:g}s (free in the Ray cluster now: "
                                   f"{_resources(ray.available_resources())})")
            ray.get(ready)  # raises the replica's own error if it failed to start
            self.progress(f"  {refs[ready[0]]} loaded ({time.monotonic() - t0:.1f}s; {len(pending)} to go)")

    def _spawn(self, rid: str, stage: Stage, restart: int = 0):
        """A new actor for replica ``rid`` (its ``restart``-th replacement; 0: the first). A
        tensor-parallel replica first gets its placement group (`cluster.tp_ranks`): the stage
        actor is rank 0 in bundle 0 and starts the other ranks in the others."""
        import ray

        sc = self.config.stages[stage]
        name = f"{self.name}-{rid}" + (f"-r{restart}" if restart else "")
        opts = dict(sc.ray_options, max_concurrency=ACTOR_MAX_CONCURRENCY, name=name, get_if_exists=False,
                    lifetime=None)
        threads = max(1, int(sc.ray_options.get("num_cpus") or 1))
        kwargs = {}
        if sc.num_ranks > 1:
            from cluster.tp_ranks import RayRankLauncher, gpu_rank_options, in_bundle, place_replica

            pg = place_replica(name, stage, sc.num_ranks, sc.ray_options, sc.placement_strategy,
                               sc.placement_timeout_s)
            self.placement_groups[rid] = pg
            opts["scheduling_strategy"] = in_bundle(pg, 0)
            opts.update(gpu_rank_options(opts))  # rank 0 opens the other ranks' GPU caches
            kwargs["ranks"] = RayRankLauncher(pg, name, dict(sc.ray_options), threads)
        return ray.remote(_stage_class(stage)).options(**opts).remote(
            rid, self.model_dir, self._engine_config(sc), self._transfer_args[stage], threads, **kwargs)

    def _remove_group(self, rid: str) -> None:
        pg = self.placement_groups.pop(rid, None)
        if pg is not None:
            from cluster.tp_ranks import remove_replica_group

            remove_replica_group(pg)

    def respawn(self, rid: str, old, restart: int):
        """Replace replica ``rid``: the old actor is killed (a stalled one must not come back), a new one
        started (`cluster.replicas.Respawn`)."""
        import ray

        try:
            ray.kill(old, no_restart=True)
        except Exception:
            pass
        self._remove_group(rid)  # every rank of a tensor-parallel replica goes with it
        stage = self.actors[rid][0]
        return self._spawn(rid, stage, restart)

    @staticmethod
    def _engine_config(sc: StageConfig):
        ec = sc.engine
        if (sc.ray_options.get("num_gpus") or 0) > 0 and ec.device == "cpu":
            ec = dataclasses.replace(ec, device="cuda")
        return ec

    def stop_actors(self) -> None:
        import ray

        # The replicas close (each frees its KV pool and ranks) in two waves, ten seconds for both:
        # first the prefill replicas, whose KV senders hang up on the decode replicas' transfer
        # servers, then the rest. (Closed together, a sender whose server went first saw its
        # channel go away mid-call, and gRPC logged it from every such replica.)
        deadline = time.monotonic() + 10
        for first in (True, False):
            closing = []
            for stage, actor in self.actors.values():
                if (stage is Stage.PREFILL) != first:
                    continue
                try:
                    closing.append(actor.close.remote())
                except Exception:
                    pass
            if closing:
                ray.wait(closing, num_returns=len(closing), timeout=max(0.0, deadline - time.monotonic()))
        for _, actor in self.actors.values():
            try:
                ray.kill(actor)
            except Exception:
                pass
        for rid in list(self.placement_groups):
            self._remove_group(rid)
        self.actors.clear()
        if self.directory is not None:
            ray.kill(self.directory)
            self.directory = None
        if self._started_ray:
            ray.shutdown()

    # ---- serving -------------------------------------------------------------
    async def start_backend(self) -> RayBackend:
        node = "127.0.0.1"
        if self._is_joined:
            import ray

            node = ray.util.get_node_ip_address()
        respawn = self.respawn if self.directory is None else self._respawn_and_publish
        on_failed = None if self.directory is None else (
            lambda rid, error: self.directory.fail.remote(rid, error))
        self.backend = await build_backend(self.config, self.model_dir, self.actors, self._is_joined, respawn,
                                           node=node, on_failed=on_failed)
        return self.backend

    async def start(self) -> Frontends | FrontendSet:
        """Actors, backend and frontends (call from the serving event loop).

        With ``frontend.replicas`` > 1 this process is the controller only:
        its backend watches and replaces the replicas, and the frontend
        actors serve (`cluster.frontend_replicas`)."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self.start_actors)
        if self.config.frontend.replicas > 1:
            await loop.run_in_executor(None, self._start_directory)
        await self.start_backend()
        if self.config.frontend.replicas > 1:
            self.frontends = await loop.run_in_executor(None, self._start_frontend_actors)
        else:
            self.frontends = await serve_frontends(self.backend, self.config.frontend)
        if self.config.profile is not None:
            self._startup_profile = asyncio.create_task(self._profile_at_startup())
        return self.frontends

    # ---- several frontends -----------------------------------------------------
    def _start_directory(self) -> None:
        import ray

        from cluster.frontend_replicas import DirectoryEntry, ReplicaDirectory

        entries = {rid: DirectoryEntry(stage, actor) for rid, (stage, actor) in self.actors.items()}
        self.directory = ray.remote(ReplicaDirectory).options(
            num_cpus=0, name=f"{self.name}-directory", lifetime=None, **_this_node()).remote(entries)

    def _respawn_and_publish(self, rid: str, old, restart: int):
        import ray

        handle = self.respawn(rid, old, restart)
        ray.get(self.directory.publish.remote(rid, handle, restart))
        return handle

    def _start_frontend_actors(self) -> FrontendSet:
        """One actor per frontend; each binds its ports (`frontend_ports`)."""
        import ray

        from cluster.frontend_replicas import FrontendReplica, frontend_ports

        fc = self.config.frontend
        cls = ray.remote(FrontendReplica)
        opts = dict(num_cpus=0, max_concurrency=8, max_restarts=self.config.health.restart_budget,
                    lifetime=None, **_this_node())
        actors = []
        try:
            for i, ports in enumerate(frontend_ports(fc)):
                actors.append(cls.options(name=f"{self.name}-frontend-{i}", **opts).remote(
                    i, self.config, self.model_dir, self.directory, self._is_joined, ports))
            ports = ray.get([a.ready.remote(self.config.health.ready_timeout_s) for a in actors])
        except BaseException:
            for a in actors:
                ray.kill(a, no_restart=True)
            raise
        return FrontendSet(actors, ports)

    async def _profile_at_startup(self) -> None:
        p = self.config.profile
        await asyncio.sleep(p.delay_s)
        try:
            traces = await self.backend.profile(p.seconds, p.out_dir, p.with_stack)
        except Exception:
            log.exception("the startup profile failed")
            return
        for t in traces:
            log.info("profile of %s: %s on %s", t.replica_id, t.path, t.host)

    async def stop(self) -> None:
        if self._startup_profile is not None and not self._startup_profile.done():
            self._startup_profile.cancel()  # stops the window on the replicas (backend.profile's finally)
            try:
                await self._startup_profile
            except asyncio.CancelledError:
                pass
        t0 = time.monotonic()
        # every phase is bounded: a stop never hangs on one part that does not answer
        if self.frontends is not None:
            await _bounded(self.frontends.stop(grace=5.0), 5.0 + STOP_PHASE_TIMEOUT_S, "the frontends")
        t1 = time.monotonic()
        if self.backend is not None:
            await _bounded(self.backend.stop(), STOP_PHASE_TIMEOUT_S, "the backend")
        t2 = time.monotonic()
        # a thread of its own: the loop's default executor may be busy with what is being stopped
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvrelay-stop") as pool:
            await asyncio.get_running_loop().run_in_executor(pool, self.stop_actors)
        t3 = time.monotonic()
        if t3 - t0 > 20:  # say where a slow stop spent its time
            log.warning("stopping took %.1fs: frontends %.1fs, backend %.1fs, actors %.1fs", t3 - t0, t1 - t0,
                        t2 - t1, t3 - t2)


def _replicas(n: int) -> str:
    return f"{n} replica" if n == 1 else f"{n} replicas"


STOP_PHASE_TIMEOUT_S = 15.0  # the most one phase of `Cluster.stop` may take before the next goes on


async def _bounded(coro, timeout_s: float, what: str) -> None:
    try:
        await within(coro, timeout_s)
    except asyncio.TimeoutError:
        log.warning("stopping: %s did not stop within %.0fs; going on", what, timeout_s)
    except Exception:
        log.exception("stopping: %s failed to stop; going on", what)


async def build_backend(config: ClusterConfig, model_dir: str, actors: dict, is_joined: bool, respawn,
                        tolerate_missing: bool = False, node: str = "127.0.0.1",
                        on_failed=None) -> RayBackend:
    """A started `RayBackend` over ``actors`` (the controller's, or a frontend actor's own view)."""
    from engine.tokenizer import Tokenizer
    from engine.weights import read_config

    model_config = read_config(model_dir)
    max_len = min(sc.engine.max_model_len or model_config.max_position_embeddings
                  for sc in config.stages.values())
    tokenizer = Tokenizer.from_folder(model_dir)
    # the request channel: on loopback, or, in a joined cluster, at this
    # node's address (spec `network`: the bind host and port range)
    host, advertise, ports = config.network.channel_bind(is_joined, node)
    backend = RayBackend(config.model, config.mode, tokenizer, max_len, model_config.vocab_size,
                         Router(config.router), actors, channel_host=host, channel_advertise_host=advertise,
                         channel_ports=ports, health=config.health, respawn=respawn,
                         on_failed=on_failed)
    backend.tokenizer_dir = model_dir  # the checkpoint folder holds the tokenizer (`kvrelay models`, /v1/models)
    await backend.start(tolerate_missing=tolerate_missing)
    return backend


@dataclasses.dataclass
class FrontendSet:
    """The frontend actors of a deployment with ``frontend.replicas`` > 1, and the ports each bound."""

    actors: list
    ports: list[tuple[int, int | None]]

    @property
    def grpc_port(self) -> int:
        return self.ports[0][0]

    @property
    def http_port(self) -> int | None:
        return self.ports[0][1]

    async def stop(self, grace: float | None = 5.0) -> None:
        import ray

        def stop_all():
            refs = [a.stop.remote(grace or 0.0) for a in self.actors]
            ray.wait(refs, num_returns=len(refs), timeout=(grace or 0.0) + 15)
            for a in self.actors:
                ray.kill(a, no_restart=True)

        await asyncio.get_running_loop().run_in_executor(None, stop_all)


def _this_node() -> dict:
    """Ray options that pin an actor to the node of this process (its frontends share its host's ports)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(),
                                                                  soft=False)}


def serve(spec: Spec) -> int:
    """`kvrelay serve`: run until SIGINT/SIGTERM, then shut down cleanly."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = split_spec(spec)
    cluster = Cluster(config)
    cluster.progress = lambda line: print(f"kvrelay: {line}", flush=True)
    return asyncio.run(_serve(cluster))


async def _serve(cluster: Cluster) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    t0 = time.monotonic()
    # a signal while starting stops the start where it is (a replica's load may take minutes, or
    # never end on a cluster that lacks its resources), then stops whatever had started
    starting = asyncio.ensure_future(cluster.start())
    signalled = asyncio.ensure_future(stop.wait())
    await asyncio.wait({starting, signalled}, return_when=asyncio.FIRST_COMPLETED)
    signalled.cancel()
    if not starting.done():
        print("kvrelay: stopping while starting", flush=True)
        cluster.start_cancelled.set()
    try:
        fe = await starting
    except StartCancelled:
        await cluster.stop()
        return 130  # (as a shell reports a command SIGINT stopped)
    except Exception as e:
        print(f"kvrelay: failed to start: {type(e).__name__}: {e}", file=sys.stderr)
        await cluster.stop()
        return 1
    if stop.is_set():  # the signal came as the start finished
        print("kvrelay: shutting down", flush=True)
        await cluster.stop()
        return 0
    # Joining a Ray cluster installs Ray's failure-signal handler over ours, which turns SIGTERM into an
    # abort (exit -6, no clean stop): take SIGINT and SIGTERM back now that Ray is up.
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    host = cluster.config.frontend.host
    print(f"kvrelay: serving {cluster.config.model} ({cluster.config.mode}, "
          f"{_replicas(len(cluster.actors))}) in {time.monotonic() - t0:.1f}s", flush=True)
    ports = fe.ports if isinstance(fe, FrontendSet) else [(fe.grpc_port, fe.http_port)]
    if len(ports) > 1:
        shared = len(set(ports)) == 1
        print(f"  {len(ports)} frontend processes" + (" sharing these ports (SO_REUSEPORT)" if shared else ""),
              flush=True)
        ports = sorted(set(ports), key=ports.index)
    for grpc_port, http_port in ports:
        print(f"  gRPC  {host}:{grpc_port}   e.g. kvrelay generate --target {host}:{grpc_port} "
              f"\"What is the capital of France?\"", flush=True)
        if http_port:
            print(f"  HTTP  http://{host}:{http_port}/v1   (OpenAI-compatible; /metrics, /health)", flush=True)
    await stop.wait()
    print("kvrelay: shutting down", flush=True)
    await cluster.stop()
    return 0
