"""A cluster started in this process, on a loop thread of its own, served on
loopback: what the end-to-end tests, the chaos suite and `cluster.bench.chaos`
drive (they need the replicas' actor handles to inject faults). Ray must be
initialized first."""
from __future__ import annotations

import asyncio
import sys
import threading
import traceback
import time
from contextlib import contextmanager

from cluster.client import KVRelayClient
from cluster.launcher import Cluster
from cluster.spec import Spec, split_spec


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
        stopping = asyncio.run_coroutine_threadsafe(cluster.stop(), loop)
        try:
            stopping.result(120)
        except TimeoutError:
            _dump_stuck(loop)  # what the stop waits on, for whoever reads the failure
            raise
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)




def _dump_stuck(loop: asyncio.AbstractEventLoop) -> None:
    """Every thread's stack and every pending task of ``loop``, on stderr."""
    print("cluster.stop() did not finish; threads:", file=sys.stderr)
    for ident, frame in sys._current_frames().items():
        print(f"--- thread {ident}", file=sys.stderr)
        traceback.print_stack(frame, file=sys.stderr)
    for task in asyncio.all_tasks(loop):
        print(f"--- task {task!r}", file=sys.stderr)
        task.print_stack(file=sys.stderr)
