"""What a running cluster exposes: every port it listens on for its own peers
refuses one without the cluster secret, the KV receivers bind the spec's port
range, and gRPC health follows a dead replica as HTTP /health does."""
from __future__ import annotations

import json
import os
import socket
import time
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvtransfer import HandshakeError, KVSender
from kvtransfer.config import SenderConfig
from protos import kvtransfer_pb2 as pb
from protos import kvtransfer_pb2_grpc as pb_grpc
from tests.e2e.conftest import disagg_spec, running_cluster

GREEDY = dict(max_tokens=6, temperature=0, ignore_eos=True)


def _free_range(n: int) -> int:
    for first in range(32000, 60000, 97):
        try:
            socks = [socket.create_server(("127.0.0.1", p)) for p in range(first, first + n)]
        except OSError:
            continue
        for s in socks:
            s.close()
        return first
    raise RuntimeError("no free port range")


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _refused_by_channel(address: str, send: bytes) -> bool:
    """A peer that sends ``send`` after the server's nonce: True if the channel closes on it."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.settimeout(5)
        nonce = s.recv(16)
        assert len(nonce) == 16
        s.sendall(send)
        try:
            return s.recv(1024) == b""  # closed, nothing said
        except ConnectionResetError:
            return True


@pytest.fixture(scope="module")
def cluster(ray_instance):
    first = _free_range(4)
    spec = disagg_spec(1, 1, "grpc", network={"kv_ports": {"first": first, "last": first + 3}},
                       frontend={"grpc_port": 0, "http_port": 0, "health_interval_s": 0.1})
    with running_cluster(spec) as rc:
        rc.kv_ports = range(first, first + 4)
        yield rc


def test_every_listening_port_refuses_a_peer_without_the_cluster_secret(cluster):
    before = cluster.client.generate("The capital of France is", **GREEDY).token_ids

    # the request channel, in the frontend's process
    address = cluster.cluster.backend.channels.address
    assert address.startswith("127.0.0.1:")
    assert _refused_by_channel(address, os.urandom(32) + os.urandom(16) + b"\0\0\0\x09decode-0")
    assert _refused_by_channel(address, b"\xff" * 200)

    # the KV receivers: exactly one per decode replica listens in the spec's range, on loopback
    listening = [p for p in cluster.kv_ports if _listening(p)]
    assert len(listening) == 1, listening
    fingerprint = {"model": "any"}
    for port in listening:
        tx = KVSender(fingerprint, SenderConfig("not-the-secret"))
        with pytest.raises(HandshakeError, match="secret"):
            tx.connect(f"grpc://127.0.0.1:{port}")
        tx.close()
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.KVTransferStub(channel)
            for call in (lambda: next(stub.Push(iter([pb.Chunk(transfer_id="x", layer=0, num_blocks=1)]),
                                                timeout=5)),
                         lambda: stub.Commit(pb.CommitRequest(transfer_id="x"), timeout=5),
                         lambda: stub.Renew(pb.RenewRequest(transfer_id="x", lease_s=1e9), timeout=5)):
                with pytest.raises(grpc.RpcError) as info:
                    call()
                assert info.value.code() is grpc.StatusCode.UNAUTHENTICATED

    # nothing was harmed: the same greedy answer, every pool free
    assert cluster.client.generate("The capital of France is", **GREEDY).token_ids == before
    assert cluster.wait_pools_free() == {rid: True for rid in cluster.cluster.actors}


def _grpc_health(target: str) -> int:
    with grpc.insecure_channel(target) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="kvrelay.v1.KVRelay"),
                                                         timeout=5).status


def _http_health(port: int) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_grpc_health_follows_a_dead_decode_replica_as_http_health_does(cluster):
    """Runs last in this module: it kills the only decode replica."""
    import ray

    assert _grpc_health(cluster.target) == health_pb2.HealthCheckResponse.SERVING
    assert _http_health(cluster.http_port)[0] == 200
    ray.kill(cluster.actor("decode-0"), no_restart=True)
    seen_grpc = seen_http = None
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not (seen_grpc and seen_http):
        if seen_grpc is None and _grpc_health(cluster.target) == health_pb2.HealthCheckResponse.NOT_SERVING:
            seen_grpc = time.monotonic()
        status, body = _http_health(cluster.http_port)
        if seen_http is None and status == 503:
            seen_http = time.monotonic()
            assert "decode" in body["reason"]
        time.sleep(0.05)
    assert seen_http is not None, "HTTP /health never said 503"
    assert seen_grpc is not None, "gRPC health never said NOT_SERVING"
    assert abs(seen_grpc - seen_http) < 2.0  # the same rule, polled every 0.1 s
    assert cluster.wait_pools_free(["prefill-0"]) == {"prefill-0": True}
