"""Faults injected into a running cluster mid-stream (SIGKILL and SIGSTOP of
a decode and of a prefill replica, a request channel cut, a KV transfer
connection cut), with concurrent streaming requests over gRPC and HTTP.
Each fault must lose no request: every one finishes with the unfaulted
greedy output (tokens over gRPC, text over HTTP), the affected ones within
5 s of the fault plus their remaining decode time; no HTTP 5xx; the faulted
replica serves again (replaced, or back); every pool ends free. Random
client cancels at every phase free every block on both sides."""
from __future__ import annotations

import random
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from cluster.bench.chaos import (HEALTH, cut_channel, cut_transfers, http_stream, is_right, metric, run_one,
                                 signal_replica)
from tests.e2e.conftest import disagg_spec, running_cluster

MAX_TOKENS = 40
PROMPTS = [f"Question {i}: tell me about the {w}." for i, w in
           enumerate(["sea", "moon", "desert", "forest", "river", "mountain", "city", "sky"])]
LONG_PROMPTS = [("Here is a long document about tides. " * 60) + f"Summarize part {i}." for i in range(4)]
GREEDY = dict(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster(ray_instance):
    spec = disagg_spec(2, 2, "grpc", router={"policy": "round_robin"}, health=HEALTH)
    with running_cluster(spec) as rc:
        yield rc


@pytest.fixture(scope="module")
def reference(cluster):
    """Unfaulted outputs and the cluster's time per output token."""
    t0 = time.monotonic()
    tokens = {p: list(cluster.client.generate(p, **GREEDY).token_ids) for p in PROMPTS + LONG_PROMPTS}
    per_token = (time.monotonic() - t0) / (len(tokens) * MAX_TOKENS)
    with ThreadPoolExecutor(len(tokens)) as pool:  # greedy text is batch-invariant: all at once
        texts = dict(zip(tokens, pool.map(lambda p: http_stream(cluster.http_port, p, GREEDY)[0], tokens)))
    return tokens, texts, per_token


class Load:
    """Streams every prompt at once, half over gRPC, half over HTTP (`cluster.bench.chaos.run_one`)."""

    def __init__(self, cluster, prompts):
        self.outcomes = []
        self.threads = [threading.Thread(target=lambda p=p, i=i: self.outcomes.append(
            run_one(cluster, p, "grpc" if i % 2 == 0 else "http", GREEDY))) for i, p in enumerate(prompts)]
        self.started = time.monotonic()
        for t in self.threads:
            t.start()

    def wait_streaming(self, cluster, min_running: int = 2, timeout_s: float = 60,
                       decodes: tuple[str, ...] = ("decode-0", "decode-1")):
        """Until each decode replica runs some of the requests, each past its first tokens."""
        deadline = time.monotonic() + timeout_s
        while True:
            st = {r.replica_id: r for r in cluster.client.status().replicas}
            if all(st[d].num_running_seqs >= min_running for d in decodes):
                time.sleep(0.2)
                return
            assert time.monotonic() < deadline, f"the streams did not start: {st}"
            time.sleep(0.02)

    def join(self, timeout_s: float = 120):
        for t in self.threads:
            t.join(timeout_s)
        assert not any(t.is_alive() for t in self.threads), "a request hung"


def _check(load: Load, reference, t_fault: float, bound_s: float):
    tokens, texts, per_token = reference
    assert len(load.outcomes) == len(load.threads)
    for o in load.outcomes:
        assert o.code == "ok", f"{o.via} {o.prompt[-24:]!r}: {o.code}"  # no 5xx, no UNAVAILABLE
        assert is_right(o, (tokens, texts)), f"{o.via} {o.prompt[-24:]!r}: wrong or missing output"
        remaining = MAX_TOKENS - sum(t <= t_fault for t in o.progress)
        assert o.end - t_fault <= bound_s + 3 * remaining * per_token, (o.via, o.end - t_fault)


def _serving_again(cluster, replica_id: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        st = {r.replica_id: r for r in cluster.client.status().replicas}[replica_id]
        if st.is_alive and st.state == "serving":
            return
        assert time.monotonic() < deadline, f"{replica_id} does not serve again: {st}"
        time.sleep(0.2)


def _pools_free(cluster):
    assert cluster.wait_pools_free(timeout_s=30) == {rid: True for rid in cluster.cluster.actors}


# the decode replicas' faults, while every request is streaming (3 tokens in)
DECODE_FAULTS = {
    "sigkill": lambda c: signal_replica(c, "decode-0", signal.SIGKILL),
    "sigstop-replaced": lambda c: signal_replica(c, "decode-1", signal.SIGSTOP, resume_after_s=8.0),
    "sigstop-back": lambda c: signal_replica(c, "decode-0", signal.SIGSTOP, resume_after_s=2.0),
    "channel-cut": lambda c: cut_channel(c, "decode-1"),
}
DECODE_FAULTED = {"sigkill": "decode-0", "sigstop-replaced": "decode-1", "sigstop-back": "decode-0",
                  "channel-cut": "decode-1"}


@pytest.mark.parametrize("fault", list(DECODE_FAULTS))
def test_a_decode_replica_fault_mid_stream_loses_no_request(cluster, reference, fault):
    migrated = metric(cluster, "kvrelay_request_migrations_total")
    load = Load(cluster, PROMPTS)
    load.wait_streaming(cluster)
    t_fault = time.monotonic()
    DECODE_FAULTS[fault](cluster)
    load.join()
    _check(load, reference, t_fault, bound_s=5.0)
    assert metric(cluster, "kvrelay_request_migrations_total") > migrated  # its requests moved
    assert metric(cluster, "kvrelay_requests_lost_total") == 0
    _serving_again(cluster, DECODE_FAULTED[fault])
    _pools_free(cluster)


# the prefill replicas' faults, while long prompts are computing or transferring
PREFILL_FAULTS = {
    "sigkill": lambda c: signal_replica(c, "prefill-1", signal.SIGKILL),
    "sigstop": lambda c: signal_replica(c, "prefill-0", signal.SIGSTOP, resume_after_s=2.5),
    "transfer-cut": lambda c: [cut_transfers(c, r) for r in ("prefill-0", "prefill-1")],
}
PREFILL_FAULTED = {"sigkill": "prefill-1", "sigstop": "prefill-0", "transfer-cut": "prefill-0"}


@pytest.mark.parametrize("fault", list(PREFILL_FAULTS))
def test_a_prefill_replica_fault_mid_prompt_loses_no_request(cluster, reference, fault):
    load = Load(cluster, LONG_PROMPTS)
    time.sleep(0.3)  # the prompts are queued, computing or transferring
    t_fault = time.monotonic()
    PREFILL_FAULTS[fault](cluster)
    load.join()
    # each ends within 5 s of the fault plus its decode and its prompt, computed again
    _check(load, reference, t_fault, bound_s=15.0)
    assert metric(cluster, "kvrelay_requests_lost_total") == 0
    _serving_again(cluster, PREFILL_FAULTED[fault])
    _pools_free(cluster)


def test_random_client_cancels_at_every_phase_free_every_block(cluster):
    """Clients that go away while queued, prefilling, transferring or decoding."""
    rng = random.Random(7)
    prompts = PROMPTS + LONG_PROMPTS
    errors = []

    def one(i):
        stream = cluster.client.stream(prompts[i % len(prompts)], **GREEDY)
        deadline = time.monotonic() + rng.uniform(0.0, 1.5)
        try:
            for _ in stream:
                if time.monotonic() > deadline:
                    break
        except Exception as e:  # noqa: BLE001
            errors.append(e)
        finally:
            stream.close()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(24)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    _pools_free(cluster)
    assert cluster.client.generate(PROMPTS[0], **GREEDY).finish_reason is not None
