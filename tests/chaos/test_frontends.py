"""Several frontend processes for one deployment (``frontend.replicas: 2``):
both serve the same replicas; losing one (SIGKILL) loses only the requests it
held, the other goes on untouched; Ray restarts the lost one, which finds
the running replicas (none is started twice) and serves again on its ports;
a replica that dies is replaced once, by the controller, and both frontends
follow the replacement. With ``reuse_port`` both listen on one port."""
from __future__ import annotations

import os
import signal
import threading
import time

import psutil
import pytest
import ray

from cluster.bench.chaos import signal_replica
from cluster.client import KVRelayClient, KVRelayError
from tests.e2e.conftest import colocated_spec, disagg_spec, running_cluster

GREEDY = dict(max_tokens=48, temperature=0, ignore_eos=True)
# generous heartbeats: with one prefill replica, a loaded machine must not take it for stalled
HEALTH = {"heartbeat_timeout_s": 5.0, "replace_after_s": 10.0, "restart_backoff_s": 0.2}
PROMPTS = [f"Story {i}: once upon a time by the {w}," for i, w in enumerate(["sea", "hill", "lake", "wood"])]


def _frontend_pid(rc, i: int) -> int:
    return ray.get(rc.cluster.frontends.actors[i].pid.remote(), timeout=30)


def _replica_actor_ids(rc) -> set[str]:
    """The live replica actors of this deployment, by name (a replacement gets a new one: <name>-<id>-r<n>)."""
    prefix = rc.cluster.name + "-"
    return {n for n in ray.util.list_named_actors()
            if n.startswith(prefix) and "-frontend-" not in n and not n.endswith("-directory")}


def _stream(client: KVRelayClient, prompt: str, out: dict, started: threading.Event | None = None) -> None:
    tokens = []
    try:
        for chunk in client.stream(prompt, **GREEDY):
            tokens.extend(chunk.token_ids)
            if started is not None and len(tokens) >= 4:
                started.set()
        out[prompt] = tokens
    except KVRelayError as e:
        out[prompt] = e.code.name
    finally:
        if started is not None:
            started.set()


@pytest.fixture(scope="module")
def deployment(ray_instance):
    spec = disagg_spec(1, 2, "grpc", frontend={"grpc_port": 0, "http_port": 0, "replicas": 2, "reuse_port": False}, health=HEALTH)
    with running_cluster(spec) as rc:
        clients = [KVRelayClient(f"127.0.0.1:{g}", timeout=120) for g, _ in rc.cluster.frontends.ports]
        yield rc, clients
        for c in clients:
            c.close()


def test_each_frontend_serves_the_same_replicas(deployment):
    rc, (a, b) = deployment
    ports = rc.cluster.frontends.ports
    assert len(set(ports)) == 2, ports  # reuse_port false: a pair of ports each
    for p in PROMPTS[:2]:
        assert list(a.generate(p, **GREEDY).token_ids) == list(b.generate(p, **GREEDY).token_ids)
    # each frontend routes over every replica, from its own load reports
    for c in (a, b):
        replicas = {r.replica_id: r for r in c.status().replicas}
        assert sorted(replicas) == ["decode-0", "decode-1", "prefill-0"]
        assert all(r.is_alive for r in replicas.values())
    assert all(rc.wait_pools_free().values())


def test_losing_a_frontend_loses_only_its_requests(deployment):
    rc, (a, b) = deployment
    reference = {p: list(a.generate(p, **GREEDY).token_ids) for p in PROMPTS}
    replicas_before = _replica_actor_ids(rc)
    on_a, on_b = {}, {}
    started = threading.Event()
    threads = [threading.Thread(target=_stream, args=(a, p, on_a)) for p in PROMPTS[:2]]
    threads += [threading.Thread(target=_stream, args=(b, p, on_b, started)) for p in PROMPTS[2:]]
    for t in threads:
        t.start()
    assert started.wait(60)
    killed_at = time.monotonic()
    os.kill(_frontend_pid(rc, 1), signal.SIGKILL)
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a request hung after its frontend died"
    # the other frontend's requests are untouched; the lost one's end with an error, not a hang
    assert on_a == {p: reference[p] for p in PROMPTS[:2]}
    assert all(v == "UNAVAILABLE" or v == reference[p] for p, v in on_b.items()), on_b
    assert time.monotonic() - killed_at < 60
    # Ray restarts it; it finds the running replicas (none started again) and serves on its own ports again
    deadline = time.monotonic() + 120
    while True:
        try:
            assert list(b.generate(PROMPTS[0], **GREEDY).token_ids) == reference[PROMPTS[0]]
            break
        except KVRelayError:
            assert time.monotonic() < deadline, "the restarted frontend does not serve"
            time.sleep(1)
    assert _replica_actor_ids(rc) == replicas_before
    # what the lost frontend's requests held on the replicas came back
    assert all(rc.wait_pools_free().values())


def test_a_replica_is_replaced_once_and_both_frontends_follow(deployment):
    rc, (a, b) = deployment
    reference = list(a.generate(PROMPTS[1], **GREEDY).token_ids)
    before = _replica_actor_ids(rc)
    signal_replica(rc, "decode-0", signal.SIGKILL)
    deadline = time.monotonic() + 120
    while True:  # the controller replaces it; both frontends take it back
        states = [{r.replica_id: r for r in c.status().replicas}["decode-0"] for c in (a, b)]
        if all(s.is_alive and s.state == "serving" and s.num_restarts == 1 for s in states):
            break
        assert time.monotonic() < deadline, states
        time.sleep(0.5)
    after = _replica_actor_ids(rc)
    assert len(after) == len(before) and len(after - before) == 1  # one replacement, not one per frontend
    for c in (a, b):
        assert list(c.generate(PROMPTS[1], **GREEDY).token_ids) == reference
    assert all(rc.wait_pools_free().values())


def test_frontends_share_one_port_with_reuse_port(ray_instance):
    spec = colocated_spec(1, frontend={"grpc_port": 0, "http_port": 0, "replicas": 2, "reuse_port": True})
    with running_cluster(spec) as rc:
        (g0, h0), (g1, h1) = rc.cluster.frontends.ports
        assert (g0, h0) == (g1, h1)
        pids = [_frontend_pid(rc, i) for i in range(2)]
        assert len(set(pids)) == 2
        for pid in pids:  # both processes listen on both ports
            listening = {c.laddr.port for c in psutil.Process(pid).net_connections("tcp")
                         if c.status == psutil.CONN_LISTEN}
            assert {g0, h0} <= listening, (pid, listening)
        reference = list(rc.client.generate(PROMPTS[0], **GREEDY).token_ids)
        os.kill(pids[0], signal.SIGKILL)
        time.sleep(0.5)
        # the other frontend takes every new connection on the shared port at once
        for _ in range(4):
            with KVRelayClient(rc.target, timeout=60) as c:
                assert list(c.generate(PROMPTS[0], **GREEDY).token_ids) == reference
        assert all(rc.wait_pools_free().values())
