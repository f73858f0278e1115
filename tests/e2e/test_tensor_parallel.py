"""Tensor-parallel replicas over the real local Ray: colocated TP=2 replicas (each two Ray
actors in a placement group) serve 16 concurrent requests token for token like engine.LLM at
TP=1, show as one unit in status and metrics, and write a trace per rank; a placement that
cannot be met and a TP that does not split the heads fail at start, fast, naming what is
wrong. (A rank's death: test_tp_faults.py.)"""
from __future__ import annotations

import json
import os
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from cluster.bench.chaos import metric
from cluster.launcher import Cluster
from cluster.spec import Spec, SpecError, split_spec
from cluster.tp_ranks import PlacementError
from tests.e2e.tp_cluster import (NUM_REQUESTS, generate, placement_groups, prompts, rank_pids,  # noqa: F401
                                  record_ranks, reference, served, tiny_model, tp_spec)


def test_colocated_tp2_equals_engine_tp1(served, prompts, reference):
    for rid in served.cluster.actors:
        pids = record_ranks(served, rid)
        assert len(pids) == 2 and len(set(pids)) == 2, pids  # rank 0 and rank 1, two processes
    assert len(placement_groups()) >= 2  # one per replica
    with ThreadPoolExecutor(NUM_REQUESTS) as pool:
        got = list(pool.map(lambda p: generate(served, p), prompts))
    for i, (g, want) in enumerate(zip(got, reference[0])):
        assert g == want, f"request {i} differs from engine.LLM at TP=1"
    assert served.wait_pools_free() == {rid: True for rid in served.cluster.actors}
    # one unit everywhere else: status shows its size and ranks, metrics a series per rank
    status = {r.replica_id: r for r in served.client.status().replicas}
    for rid, r in status.items():
        assert r.is_alive and r.tensor_parallel_size == 2 and list(r.rank_pids) == rank_pids(served, rid)
    assert metric(served, "kvrelay_replica_tensor_parallel_size") == 4  # two replicas of two ranks
    body = urllib.request.urlopen(f"http://127.0.0.1:{served.http_port}/metrics", timeout=10).read().decode()
    for rid, r in status.items():
        for rank, pid in enumerate(r.rank_pids):
            assert (f'kvrelay_replica_rank_pid{{model_name="{served.cluster.config.model}",rank="{rank}",'
                    f'replica="{rid}",stage="colocated"}} {float(pid)}') in body


def test_the_profiler_writes_a_trace_per_rank(served, prompts, tmp_path):
    out = tmp_path / "traces"
    done = threading.Event()

    def load(p):  # both replicas step all through the window
        while not done.is_set():
            generate(served, p)
    workers = [threading.Thread(target=load, args=(p,)) for p in prompts[:4]]
    for w in workers:
        w.start()
    try:
        traces = served.client.profile(1.5, str(out))
    finally:
        done.set()
        for w in workers:
            w.join(60)
    by_replica: dict[str, list[str]] = {}
    for t in traces:
        by_replica.setdefault(t.replica_id, []).append(os.path.basename(t.path))
    assert sorted(by_replica) == sorted(served.cluster.actors)
    for rid, names in by_replica.items():
        assert len(names) == 2 and names[0].startswith(f"{rid}-2") and names[1].startswith(f"{rid}-rank1-"), names
    for t in traces:
        events = json.loads(open(t.path).read())["traceEvents"]
        assert any(str(e.get("name", "")).startswith("aten::") for e in events), t.path  # the rank's own ops


def test_unsatisfiable_placement_fails_fast_naming_the_bundles(ray_instance, tiny_model):
    groups = len(placement_groups())
    cluster = Cluster(split_spec(Spec.model_validate(tp_spec(tiny_model, replicas=1, resources={"num_cpus": 3}))))
    t0 = time.monotonic()
    with pytest.raises(PlacementError) as e:
        cluster.start_actors()
    assert time.monotonic() - t0 < 10
    msg = str(e.value)
    assert "colocated" in msg and "2 bundles" in msg and "'CPU': 3.0" in msg and "CPU 4" in msg, msg
    cluster.stop_actors()
    assert len(placement_groups()) == groups


def test_tp_not_dividing_the_heads_is_a_spec_error(ray_instance, tiny_model):
    cluster = Cluster(split_spec(Spec.model_validate(tp_spec(tiny_model, replicas=1, tp=3))))
    with pytest.raises(SpecError) as e:
        cluster.start_actors()
    assert "colocated.tensor_parallel_size: 3 does not divide the model's num_attention_heads (4)" in str(e.value)
    assert cluster.actors == {}
