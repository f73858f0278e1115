"""A real local Ray instance shared by the end-to-end tests, and clusters
started on it from spec dicts, served on loopback."""
from __future__ import annotations

import asyncio
import threading
import time
from contextlib import contextmanager

import pytest

from cluster.client import KVRelayClient
from cluster.launcher import Cluster
from cluster.spec import Spec, split_spec

# Replicas ask for a slice of a CPU so several fit on a 2-core machine.
SLICE = {"num_cpus": 0.25}


@pytest.fixture(scope="session")
def ray_instance():
    import ray

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    yield ray
    ray.shutdown()


class RunningCluster:
    def __init__(self, cluster: Cluster, loop: asyncio.AbstractEventLoop):
        self.cluster = cluster
        self.loop = loop
        self.target = f"127.0.0.1:{cluster.frontends.grpc_port}"
        self.http_port = cluster.frontends.http_port
        self.client = KVRelayClient(self.target, timeout=120)

    def actor(self, replica_id: str):
        return self.cluster.actors[replica_id][1]

    def run(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def pools_free(self, replica_ids=None) -> dict[str, bool]:
        import ray

        ids = replica_ids or list(self.cluster.actors)
        return {rid: ray.get(self.actor(rid).is_fully_free.remote(), timeout=30) for rid in ids}

    def wait_pools_free(self, replica_ids=None, timeout_s: float = 20.0) -> dict[str, bool]:
        deadline = time.monotonic() + timeout_s
        while True:
            state = self.pools_free(replica_ids)
            if all(state.values()) or time.monotonic() > deadline:
                return state
            time.sleep(0.2)


@contextmanager
def running_cluster(spec: dict):
    """Start a cluster from a spec dict on the session's Ray; yield a RunningCluster."""
    spec = dict({"dtype": "float32", "frontend": {"grpc_port": 0, "http_port": 0}}, **spec)
    cluster = Cluster(split_spec(Spec.model_validate(spec)))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        asyncio.run_coroutine_threadsafe(cluster.start(), loop).result(600)
        rc = RunningCluster(cluster, loop)
        yield rc
        rc.client.close()
    finally:
        asyncio.run_coroutine_threadsafe(cluster.stop(), loop).result(120)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def disagg_spec(prefill: int = 2, decode: int = 2, backend: str = "grpc", **extra) -> dict:
    spec = {
        "mode": "disaggregated",
        "prefill": {"replicas": prefill, "resources": SLICE, "num_kv_blocks": 192, "max_num_batched_tokens": 512},
        "decode": {"replicas": decode, "resources": SLICE, "num_kv_blocks": 192},
        "transfer": {"backend": backend, "options": {"lease_s": 20, "deadline_s": 30}},
    }
    for k, v in extra.items():
        spec[k] = dict(spec.get(k, {}), **v) if isinstance(v, dict) else v
    return spec


def colocated_spec(replicas: int = 2, **extra) -> dict:
    spec = {"mode": "colocated",
            "colocated": {"replicas": replicas, "resources": SLICE, "num_kv_blocks": 192,
                          "max_num_batched_tokens": 512}}
    for k, v in extra.items():
        spec[k] = dict(spec.get(k, {}), **v) if isinstance(v, dict) else v
    return spec
