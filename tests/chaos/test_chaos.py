"""Faults injected into a running cluster mid-stream (SIGKILL and SIGSTOP of
a decode and of a prefill replica, a request channel cut, a KV transfer
connection cut), with concurrent streaming requests over gRPC and HTTP.
Each fault must lose no request: every one finishes with the unfaulted
greedy output (tokens over gRPC, text over HTTP), the affected ones within
5 s of the fault plus their remaining decode time; no HTTP 5xx; the faulted
replica serves again (replaced, or back); every pool ends free. Random
client cancels at every phase free every block on both sides."""
from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
import urllib.request

import pytest

from tests.e2e.conftest import disagg_spec, running_cluster

MAX_TOKENS = 40
PROMPTS = [f"Question {i}: tell me about the {w}." for i, w in
           enumerate(["sea", "moon", "desert", "forest", "river", "mountain", "city", "sky"])]
LONG_PROMPTS = [("Here is a long document about tides. " * 60) + f"Summarize part {i}." for i in range(4)]
GREEDY = dict(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
HEALTH = {"heartbeat_timeout_s": 1.0, "replace_after_s": 4.0, "restart_backoff_s": 0.2}


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
    texts = {p: _http_stream(cluster, p)[0] for p in PROMPTS}
    return tokens, texts, per_token


def _pid(cluster, replica_id: str) -> int:
    import ray

    return ray.get(cluster.actor(replica_id).__ray_call__.remote(lambda self: os.getpid()), timeout=30)


def _http_stream(cluster, prompt: str, on_token=None) -> tuple[str, int]:
    """A streamed /v1/completions request: (text, HTTP status)."""
    body = json.dumps(dict(model="", prompt=prompt, stream=True, **GREEDY)).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{cluster.http_port}/v1/completions", body,
                                 {"content-type": "application/json"})
    text = []
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            for line in resp:
                line = line.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return "".join(text), 503 if "unavailable" in json.dumps(event).lower() else 500
                for c in event.get("choices", []):
                    text.append(c.get("text") or "")
                    if on_token is not None and c.get("text"):
                        on_token()
            return "".join(text), resp.status
    except urllib.error.HTTPError as e:
        return "".join(text), e.code


class Load:
    """Streams every prompt at once, half over gRPC, half over HTTP, recording when each ended."""

    def __init__(self, cluster, prompts):
        self.results: dict[str, object] = {}
        self.ended: dict[str, float] = {}
        self.progress: dict[str, int] = {p: 0 for p in prompts}
        self.threads = [threading.Thread(target=self._run, args=(cluster, p, i % 2 == 0)) for i, p in
                        enumerate(prompts)]
        for t in self.threads:
            t.start()

    def _tick(self, p):
        self.progress[p] += 1

    def _run(self, cluster, prompt, grpc_client: bool):
        from cluster.client import KVRelayError

        try:
            if grpc_client:
                out = []
                for c in cluster.client.stream(prompt, **GREEDY):
                    out.extend(c.token_ids)
                    if c.token_ids:
                        self._tick(prompt)
                self.results[prompt] = ("grpc", out)
            else:
                self.results[prompt] = ("http",) + _http_stream(cluster, prompt, lambda: self._tick(prompt))
        except KVRelayError as e:
            self.results[prompt] = ("grpc-error", e.code)
        self.ended[prompt] = time.monotonic()

    def wait_streaming(self, min_tokens: int = 3, timeout_s: float = 60):
        deadline = time.monotonic() + timeout_s
        while min(self.progress.values()) < min_tokens:
            assert time.monotonic() < deadline, f"the streams did not start: {self.progress}"
            time.sleep(0.02)

    def join(self, timeout_s: float = 120):
        for t in self.threads:
            t.join(timeout_s)
        assert not any(t.is_alive() for t in self.threads), "a request hung"


def _check(load: Load, reference, t_fault: float):
    tokens, texts, per_token = reference
    for p, r in load.results.items():
        if r[0] == "grpc":
            assert r[1] == tokens[p], f"gRPC {p!r}: wrong or missing tokens"
        else:
            assert r[0] == "http", f"{p!r}: {r}"
            text, status = r[1], r[2]
            assert status == 200, f"HTTP {p!r}: status {status}"
            assert text == texts[p], f"HTTP {p!r}: wrong text"
    assert len(load.results) == len(load.progress)
    for p, end in load.ended.items():
        remaining = MAX_TOKENS - 3  # every stream had 3 tokens at the fault
        assert end - t_fault <= 5.0 + 3 * remaining * per_token, (p, end - t_fault)


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


def _metric(cluster, name: str) -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{cluster.http_port}/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in body.splitlines() if line.startswith(name))


def _signal(cluster, replica_id: str, sig: int, resume_after_s: float | None = None):
    pid = _pid(cluster, replica_id)
    os.kill(pid, sig)
    if resume_after_s is not None:
        threading.Timer(resume_after_s, lambda: _cont(pid)).start()


def _cont(pid: int):
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:  # replaced (killed) meanwhile
        pass


def _cut_channel(cluster, replica_id: str):
    async def cut():
        cluster.cluster.backend.channels.drop(replica_id)
    cluster.run(cut())


# the decode replicas' faults, while every request is streaming (3 tokens in)
DECODE_FAULTS = {
    "sigkill": lambda c: _signal(c, "decode-0", signal.SIGKILL),
    "sigstop-replaced": lambda c: _signal(c, "decode-1", signal.SIGSTOP, resume_after_s=8.0),
    "sigstop-back": lambda c: _signal(c, "decode-0", signal.SIGSTOP, resume_after_s=2.0),
    "channel-cut": lambda c: _cut_channel(c, "decode-1"),
}
DECODE_FAULTED = {"sigkill": "decode-0", "sigstop-replaced": "decode-1", "sigstop-back": "decode-0",
                  "channel-cut": "decode-1"}


@pytest.mark.parametrize("fault", list(DECODE_FAULTS))
def test_a_decode_replica_fault_mid_stream_loses_no_request(cluster, reference, fault):
    migrated = _metric(cluster, "kvrelay_request_migrations_total")
    load = Load(cluster, PROMPTS)
    load.wait_streaming()
    t_fault = time.monotonic()
    DECODE_FAULTS[fault](cluster)
    load.join()
    _check(load, reference, t_fault)
    assert _metric(cluster, "kvrelay_request_migrations_total") > migrated  # its requests moved
    assert _metric(cluster, "kvrelay_requests_lost_total") == 0
    _serving_again(cluster, DECODE_FAULTED[fault])
    _pools_free(cluster)


def _cut_transfers(cluster, replica_id: str):
    """Close the prefill replica's KV transfer links under the transfers in flight."""
    def close_links(stage):
        for link in list(stage.sender._links.values()):
            link.close()
    cluster.actor(replica_id).__ray_call__.remote(close_links)


# the prefill replicas' faults, while long prompts are computing or transferring
PREFILL_FAULTS = {
    "sigkill": lambda c: _signal(c, "prefill-1", signal.SIGKILL),
    "sigstop": lambda c: _signal(c, "prefill-0", signal.SIGSTOP, resume_after_s=2.5),
    "transfer-cut": lambda c: [_cut_transfers(c, r) for r in ("prefill-0", "prefill-1")],
}
PREFILL_FAULTED = {"sigkill": "prefill-1", "sigstop": "prefill-0", "transfer-cut": "prefill-0"}


@pytest.mark.parametrize("fault", list(PREFILL_FAULTS))
def test_a_prefill_replica_fault_mid_prompt_loses_no_request(cluster, reference, fault):
    load = Load(cluster, LONG_PROMPTS)
    time.sleep(0.3)  # the prompts are queued, computing or transferring
    t_fault = time.monotonic()
    PREFILL_FAULTS[fault](cluster)
    load.join()
    tokens, _, per_token = reference
    for p, r in load.results.items():
        if r[0] == "grpc":
            assert r[1] == tokens[p], f"gRPC {p[-20:]!r}: wrong or missing tokens"
        else:
            assert r[0] == "http" and r[2] == 200 and r[1], r
    # each ends within 5 s of the fault plus its decode and (again) its prompt
    assert max(load.ended.values()) - t_fault < 5.0 + 3 * MAX_TOKENS * per_token + 10.0
    assert _metric(cluster, "kvrelay_requests_lost_total") == 0
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
