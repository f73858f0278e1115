"""Tensor-parallel replicas over the real local Ray: colocated TP=2 replicas (each two Ray
actors in a placement group) serve 16 concurrent requests token for token like engine.LLM at
TP=1; a rank SIGKILLed mid-stream takes its replica down, its requests migrate, the replica is
replaced as a whole (new ranks, new placement group) and nothing is left behind; a placement
that cannot be met and a TP that does not split the heads fail at start, fast, naming what is
wrong."""
from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from cluster.bench.chaos import HEALTH, metric
from cluster.launcher import Cluster
from cluster.spec import Spec, SpecError, split_spec
from cluster.tp_ranks import PlacementError
from engine.llm import LLM
from engine.parallel.shm import SEGMENT_PREFIX, SHM_DIR
from engine.sampling import SamplingParams
from tests.e2e.conftest import SLICE, running_cluster
from tests.engine.factories import random_prompts, save_tiny_model_with_tokenizer

MAX_TOKENS = 12
NUM_REQUESTS = 16


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, default_model_dir):
    """A tiny random llama (4 heads, 2 KV heads) with the default model's tokenizer."""
    folder = tmp_path_factory.mktemp("tiny-tp")
    save_tiny_model_with_tokenizer(folder, default_model_dir)
    return folder


@pytest.fixture(scope="module")
def prompts(tiny_model):
    return random_prompts(NUM_REQUESTS, 2000, [5, 19, 33, 40])


LONG = dict(max_tokens=100, temperature=0, ignore_eos=True)  # the streams a rank dies under
NUM_LONG = 8


@pytest.fixture(scope="module")
def reference(tiny_model, prompts):
    """engine.LLM at TP=1, greedy fp32: the 16 requests, and the first 8 at LONG."""
    llm = LLM(str(tiny_model), dtype="float32", num_kv_blocks=128)
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    long = llm.generate(prompts[:NUM_LONG], SamplingParams(**LONG))
    assert llm.core.pool.is_fully_free()
    return [o.token_ids for o in outs], [o.token_ids for o in long]


TP_TIMEOUT_S = 5.0  # a collective that waits longer fails the replica


def tp_spec(model, replicas: int = 2, tp: int = 2, **stage) -> dict:
    return {"model": str(model), "mode": "colocated", "router": {"policy": "round_robin"}, "health": HEALTH,
            "colocated": dict({"replicas": replicas, "tensor_parallel_size": tp, "resources": SLICE,
                               "tp_timeout_s": TP_TIMEOUT_S,
                               "num_kv_blocks": 64, "max_num_batched_tokens": 256}, **stage)}


def placement_groups() -> list[dict]:
    import ray

    return [g for g in ray.util.placement_group_table().values() if g["state"] == "CREATED"]


def segments(pids) -> set[str]:
    """The shared-memory segments that rank 0 processes among ``pids`` created (named by their pid)."""
    mine = {f"{SEGMENT_PREFIX}{p}-" for p in pids}
    return {n for n in os.listdir(SHM_DIR) if n[:n.rfind("-") + 1] in mine}


def is_running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(pids, timeout_s: float = 20.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(is_running(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if is_running(p)]


def rank_pids(rc, rid: str) -> list[int]:
    import ray

    return ray.get(rc.actor(rid).rank_pids.remote(), timeout=30)


def generate(rc, prompt):
    return list(rc.client.generate(token_ids=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                   ignore_eos=True).token_ids)


@pytest.fixture(scope="module")
def served(ray_instance, tiny_model):
    groups_before = len(placement_groups())
    with running_cluster(tp_spec(tiny_model)) as rc:
        yield rc
    # stopped: no placement group, no rank process, no segment left
    assert len(placement_groups()) == groups_before
    assert wait_gone(served_pids) == []
    assert segments(served_pids) == set()


served_pids: list[int] = []  # every rank process the module's cluster ever had


def test_colocated_tp2_equals_engine_tp1(served, prompts, reference):
    for rid in served.cluster.actors:
        pids = rank_pids(served, rid)
        assert len(pids) == 2 and len(set(pids)) == 2, pids  # rank 0 and rank 1, two processes
        served_pids.extend(pids)
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
            assert f'kvrelay_replica_rank_pid{{rank="{rank}",replica="{rid}",stage="colocated"}} {float(pid)}' \
                in body


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


@pytest.mark.parametrize("victim, rank, sig", [("colocated-0", 1, signal.SIGKILL), ("colocated-1", 0, signal.SIGKILL),
                                              ("colocated-0", 1, signal.SIGSTOP)],
                         ids=["rank1-sigkill", "rank0-sigkill", "rank1-sigstop"])
def test_a_rank_killed_mid_stream_takes_its_replica_down_and_it_is_replaced(served, prompts, reference,
                                                                           victim, rank, sig):
    """SIGKILL: the replica goes at once. SIGSTOP: rank 0's all-reduce gives up after tp_timeout_s
    (TP_TIMEOUT_S here), tears the group down (the stopped rank is killed) and the replica goes."""
    groups = len(placement_groups())
    old = rank_pids(served, victim)
    migrated = metric(served, "kvrelay_request_migrations_total")
    want = reference[1]
    results: dict[int, list[int] | Exception] = {}
    ends: dict[int, float] = {}

    def one(i):
        try:
            results[i] = list(served.client.generate(token_ids=prompts[i], **LONG).token_ids)
        except Exception as e:  # noqa: BLE001 - asserted below
            results[i] = e
        ends[i] = time.monotonic()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(NUM_LONG)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while {r.replica_id: r for r in served.client.status().replicas}[victim].num_running_seqs < 2:
        assert time.monotonic() < deadline, "the streams did not start on the victim"
        time.sleep(0.02)
    t_fault = time.monotonic()
    os.kill(old[rank], sig)  # rank 0 is the stage actor; rank 1 a rank actor
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a request hung"
    for i in range(NUM_LONG):
        assert results[i] == want[i], f"request {i}: {results[i]!r}"
        assert ends[i] - t_fault < 30, f"request {i} ended {ends[i] - t_fault:.1f} s after the fault"
    assert metric(served, "kvrelay_request_migrations_total") > migrated  # the victim's requests moved
    assert metric(served, "kvrelay_requests_lost_total") == 0
    # the whole replica is replaced: new ranks in a new placement group, the old ones gone
    deadline = time.monotonic() + 60
    while True:
        st = {r.replica_id: r for r in served.client.status().replicas}[victim]
        if st.is_alive and st.state == "serving" and st.num_restarts >= 1 and st.rank_pids != tuple(old):
            break
        assert time.monotonic() < deadline, f"{victim} is not replaced: {st}"
        time.sleep(0.2)
    if sig == signal.SIGSTOP:
        assert f"(timeout {TP_TIMEOUT_S:g} s) for a peer" in st.last_error, st.last_error
    elif rank == 1:  # rank 0 saw it go and took the replica down, saying which
        assert f"rank 1 (pid {old[1]}) is gone" in st.last_error, st.last_error
    new = rank_pids(served, victim)
    served_pids.extend(new)
    assert not set(new) & set(old)
    assert wait_gone(old) == [], "a rank of the replaced replica is still running"
    assert len(placement_groups()) == groups
    assert served.wait_pools_free() == {rid: True for rid in served.cluster.actors}
    # and it serves, token for token
    assert generate(served, prompts[0]) == reference[0][0]


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
