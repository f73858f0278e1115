"""A rank of a tensor-parallel replica killed (SIGKILL of rank 1 or of rank 0, the stage
actor) or stopped (SIGSTOP) mid-stream, over the real local Ray: its replica goes down, its
requests migrate and end token for token within the bound, the cluster goes on serving, the
replica is replaced as a whole (new ranks, a new placement group) and nothing is left behind."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from cluster.bench.chaos import metric
from tests.e2e.tp_cluster import (LONG, NUM_LONG, TP_TIMEOUT_S, generate, placement_groups, prompts,  # noqa: F401
                                  record_ranks, reference, served, tiny_model, wait_gone)


@pytest.mark.parametrize("victim, rank, sig", [("colocated-0", 1, signal.SIGKILL), ("colocated-1", 0, signal.SIGKILL),
                                              ("colocated-0", 1, signal.SIGSTOP)],
                         ids=["rank1-sigkill", "rank0-sigkill", "rank1-sigstop"])
def test_a_rank_killed_mid_stream_takes_its_replica_down_and_it_is_replaced(served, prompts, reference,
                                                                           victim, rank, sig):
    """SIGKILL: the replica goes at once. SIGSTOP: rank 0's all-reduce gives up after tp_timeout_s
    (TP_TIMEOUT_S here), tears the group down (the stopped rank is killed) and the replica goes."""
    groups = len(placement_groups())
    old = record_ranks(served, victim)
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
    new = record_ranks(served, victim)
    assert not set(new) & set(old)
    assert wait_gone(old) == [], "a rank of the replaced replica is still running"
    assert len(placement_groups()) == groups
    assert served.wait_pools_free() == {rid: True for rid in served.cluster.actors}
    # and it serves, token for token
    assert generate(served, prompts[0]) == reference[0][0]
