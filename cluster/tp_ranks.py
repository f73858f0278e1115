"""Tensor-parallel replicas on Ray: one placement group per replica, one bundle per rank.

    pg = place_replica(name, stage, sc)              # bounded wait; PlacementError names what is missing
    stage actor (rank 0) in bundle 0, given RayRankLauncher(pg, ...)
      -> its TPGroup starts ranks 1..N-1 as RankActors in bundles 1..N-1
    remove_replica_group(pg)                         # replaced or stopped: every rank goes with it

Rank 0 is the stage actor (scheduler, block pool, request channel, KV
endpoint); the other ranks run the engine's worker loop
(`engine.parallel.worker.worker_main`) inside a Ray actor and dial back to
rank 0 over an authenticated loopback socket. The ranks share memory (the
step channel and, with tp_backend shm, the all-reduce segment), so they must
sit on one host: STRICT_PACK guarantees it; PACK is accepted and checked
once the group is placed (a group Ray spread over nodes is refused); SPREAD
and STRICT_SPREAD are refused by the spec.

Ownership does the cleanup: the rank actors are created by rank 0, so Ray
ends them with it, and removing the placement group ends every actor in it.
A rank that dies takes the replica down (rank 0's loop checks its ranks'
processes each round, `TPGroup.check_ranks`); a rank 0 that dies is seen by
the other ranks within milliseconds (a pidfd), and they exit.

GPUs: every rank actor of a GPU replica (rank 0 too: `gpu_rank_options` in
the launcher) is started with Ray told not to set its CUDA_VISIBLE_DEVICES,
and sets it itself before CUDA starts (`see_replica_gpus`): its bundle's GPU
first, then the node's others (`engine.parallel.devices.replica_visible_devices`).
Each rank runs on its own GPU as ``cuda:0``, and rank 0, the replica's one KV
endpoint, opens every rank's cache from its CUDA IPC handles.
"""
from __future__ import annotations

import dataclasses
import os

from cluster.types import Stage
from engine.parallel.comm import CollectiveError
from engine.parallel.launch import PidWatch, RankListener, dial_rank0
from engine.parallel.worker import WorkerSpec

# what the spec's resources are called in a bundle
_RESOURCE_NAMES = {"num_cpus": "CPU", "num_gpus": "GPU"}
# Ray's switch that leaves an actor's CUDA_VISIBLE_DEVICES as the node's (see_replica_gpus sets it)
NOSET_VISIBLE_DEVICES = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"


class PlacementError(RuntimeError):
    """A replica's placement group cannot be placed: the message names the stage, the bundles and
    what the cluster has."""


def rank_bundle(ray_options: dict) -> dict[str, float]:
    """One rank's bundle from a stage's per-rank Ray options (zero amounts left out)."""
    bundle = {_RESOURCE_NAMES[k]: float(v) for k, v in ray_options.items() if k in _RESOURCE_NAMES and v}
    bundle.update({k: float(v) for k, v in (ray_options.get("resources") or {}).items() if v})
    return bundle


def _what_the_cluster_has(keys) -> str:
    import ray

    total, free = ray.cluster_resources(), ray.available_resources()
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    per_node = "; ".join(", ".join(f"{k} {n.get(k, 0):g}" for k in keys) for n in nodes)
    return (", ".join(f"{k} {total.get(k, 0):g} ({free.get(k, 0):g} free)" for k in keys)
            + f" over {len(nodes)} node(s)" + (f" [{per_node}]" if len(nodes) > 1 else ""))


def _describe(stage: Stage, bundles: list[dict[str, float]], strategy: str) -> str:
    return (f"{stage.value}: a tensor-parallel replica asks for {len(bundles)} bundles of "
            f"{bundles[0] or '{}'} ({strategy})")


def place_replica(name: str, stage: Stage, size: int, ray_options: dict, strategy: str, timeout_s: float):
    """A placement group of ``size`` bundles of one rank's resources, placed (at most ``timeout_s``).
    Refused at once where no node could ever hold it; a group spread over nodes is refused too."""
    import ray
    from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

    bundles = [rank_bundle(ray_options) for _ in range(size)]
    keys = sorted(set(bundles[0]) | {"CPU"})
    need = {k: sum(b.get(k, 0.0) for b in bundles) for k in keys}
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    if strategy == "STRICT_PACK":
        fits = any(all(n.get(k, 0.0) >= v for k, v in need.items()) for n in nodes)
    else:
        fits = all(ray.cluster_resources().get(k, 0.0) >= v for k, v in need.items())
    if not fits:
        where = "no node has" if strategy == "STRICT_PACK" else "the cluster does not have"
        raise PlacementError(f"{_describe(stage, bundles, strategy)}: {where} "
                             f"{', '.join(f'{k} {v:g}' for k, v in need.items())} in all; "
                             f"the cluster has {_what_the_cluster_has(keys)}")
    pg = placement_group(bundles, strategy=strategy, name=f"{name}-ranks")
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(pg)
        raise PlacementError(f"{_describe(stage, bundles, strategy)}, not placed within {timeout_s:g} s: "
                             f"the cluster has {_what_the_cluster_has(keys)} (other replicas hold the rest)")
    node_ids = set(placement_group_table(pg).get("bundles_to_node_id", {}).values())
    if len(node_ids) > 1:
        remove_placement_group(pg)
        raise PlacementError(f"{_describe(stage, bundles, strategy)}: Ray placed its ranks on {len(node_ids)} "
                             "nodes, and the ranks share memory (one host); use placement_strategy STRICT_PACK")
    return pg


def remove_replica_group(pg) -> None:
    """Remove a replica's placement group: every actor in it (each rank) is ended."""
    from ray.util.placement_group import remove_placement_group

    try:
        remove_placement_group(pg)
    except Exception:  # noqa: BLE001 - already removed, or Ray is going down
        pass


def gpu_rank_options(ray_options: dict) -> dict:
    """The Ray options every rank actor of a GPU replica needs besides its resources (none on CPU):
    Ray must not narrow its CUDA_VISIBLE_DEVICES to its own GPU, or rank 0 could not open the other
    ranks' caches; the rank sets it itself (`see_replica_gpus`)."""
    if not ray_options.get("num_gpus"):
        return {}
    runtime_env = dict(ray_options.get("runtime_env") or {})
    runtime_env["env_vars"] = dict(runtime_env.get("env_vars") or {}, **{NOSET_VISIBLE_DEVICES: "1"})
    return {"runtime_env": runtime_env}


def see_replica_gpus(rank: int) -> str:
    """In a rank's Ray actor, before CUDA starts in its process: CUDA_VISIBLE_DEVICES set to its
    bundle's GPU first, then the node's other GPUs (returned). Raises where CUDA already started
    (the setting would not apply) or where Ray gave the actor no GPU."""
    import ray
    import torch

    from engine.parallel.devices import VISIBLE_DEVICES, replica_visible_devices

    node_id = ray.get_runtime_context().get_node_id()
    num_node_gpus = int(next((n["Resources"].get("GPU", 0) for n in ray.nodes() if n.get("NodeID") == node_id), 0))
    visible = replica_visible_devices(rank, ray.get_gpu_ids(), os.environ.get(VISIBLE_DEVICES), num_node_gpus)
    if os.environ.get(VISIBLE_DEVICES) != visible:
        if torch.cuda.is_initialized():
            raise RuntimeError(f"tensor-parallel rank {rank}: CUDA started in this process before its GPUs were "
                               f"chosen ({VISIBLE_DEVICES}={visible}); nothing may touch CUDA before the group")
        os.environ[VISIBLE_DEVICES] = visible
    return visible


def in_bundle(pg, index: int):
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index,
                                            placement_group_capture_child_tasks=False)


class RankActor:
    """One tensor-parallel rank > 0 of a replica, hosted by Ray: the engine's worker loop."""

    def run(self, spec: WorkerSpec, address, authkey: bytes) -> None:
        import ray

        from engine.parallel.worker import worker_main
        from engine.serving.stage_loop import normal_priority

        normal_priority()  # a rank works as hard as its rank 0: not from Ray's niceness 15
        if spec.config.device.startswith("cuda"):
            see_replica_gpus(spec.rank)
        worker_main(spec, dial_rank0(address, authkey, spec.rank))
        ray.actor.exit_actor()  # stopped, aborted, or rank 0 gone: this process goes too


class RayRank(PidWatch):
    """A rank actor as rank 0's group watches it: its process (same host) and its handle."""

    def __init__(self, pid: int, actor):
        super().__init__(pid)
        self.actor = actor

    def kill(self) -> None:
        try:
            import ray

            ray.kill(self.actor, no_restart=True)
        except Exception:  # noqa: BLE001 - Ray is going down: the signal below does it
            pass
        self.join(2.0)
        super().kill()


@dataclasses.dataclass
class RayRankLauncher:
    """`engine.parallel.launch.RankLauncher` for a replica's placement group (picklable: the
    launcher makes it, the stage actor uses it)."""

    pg: object
    name: str  # the replica's actor name; ranks are <name>-rank<r>
    ray_options: dict  # one rank's num_cpus / num_gpus / resources
    num_threads: int | None = None
    isolates_devices = True  # each GPU rank's cuda:0 is its bundle's GPU (see_replica_gpus)

    def see_devices(self, device: str) -> None:
        if device.startswith("cuda"):
            see_replica_gpus(0)

    def start(self, specs: list[WorkerSpec], timeout_s: float):
        import ray

        listener = RankListener()
        actors, runs = {}, {}
        try:
            opts = {k: v for k, v in self.ray_options.items() if k in ("num_cpus", "num_gpus", "resources")}
            opts.update(gpu_rank_options(opts))
            for spec in specs:
                actor = ray.remote(RankActor).options(
                    **opts, name=f"{self.name}-rank{spec.rank}", max_restarts=0,
                    scheduling_strategy=in_bundle(self.pg, spec.rank)).remote()
                actors[spec.rank] = actor
                runs[spec.rank] = actor.run.remote(dataclasses.replace(spec, leader_pid=os.getpid()),
                                                   listener.address, listener.authkey)

            def failed_early() -> None:
                ready, _ = ray.wait(list(runs.values()), num_returns=len(runs), timeout=0)
                for rank, ref in runs.items():
                    if ref not in ready:
                        continue
                    try:
                        ray.get(ref)
                    except Exception as e:
                        raise CollectiveError(f"tensor-parallel rank {rank} failed to start: "
                                              f"{type(e).__name__}: {e}") from None
                    raise CollectiveError(f"tensor-parallel rank {rank} ended before it connected")

            conns = listener.accept(sorted(runs), timeout_s, failed_early)
        except BaseException:
            for actor in actors.values():
                try:
                    ray.kill(actor, no_restart=True)
                except Exception:  # noqa: BLE001
                    pass
            raise
        finally:
            listener.close()
        return [(RayRank(conns[s.rank][0], actors[s.rank]), conns[s.rank][1]) for s in specs]
