"""gRPC health follows replica liveness exactly as HTTP /health does; reflection v1 and v1alpha."""
import asyncio
import json
import queue
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from cluster.health import unhealthy_reason
from cluster.types import ClusterStatus, ReplicaStatus, Stage
from tests.cluster.conftest import EchoBackend
from tests.cluster.test_http import ServedFrontends

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
SERVICES = ("", "kvrelay.v1.KVRelay")


@pytest.fixture(scope="module")
def both():
    server = ServedFrontends(EchoBackend(), health_interval_s=0.05)
    yield server
    server.close()


@pytest.fixture
def served(both):
    both.backend.reset()
    wait_until(lambda: grpc_health(both) == {s: SERVING for s in SERVICES})
    yield both
    both.backend.reset()


def wait_until(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.02)
    return True


def grpc_health(served) -> dict[str, int]:
    with grpc.insecure_channel(served.grpc_target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return {s: stub.Check(health_pb2.HealthCheckRequest(service=s), timeout=5).status for s in SERVICES}


def http_health(served) -> int:
    return served.get("/health")[0]


@pytest.mark.parametrize("fault", ["no_replica", "status_error"])
def test_check_follows_liveness_as_http_health_does(served, fault):
    assert http_health(served) == 200
    if fault == "no_replica":
        served.backend.no_replica = True  # c0 dead too: no live colocated replica
    else:
        served.backend.status_error = RuntimeError("the router is gone")
    assert http_health(served) == 503
    assert wait_until(lambda: grpc_health(served) == {s: NOT_SERVING for s in SERVICES}, timeout=2.0)
    served.backend.reset()
    assert http_health(served) == 200
    assert wait_until(lambda: grpc_health(served) == {s: SERVING for s in SERVICES}, timeout=2.0)


def test_watch_streams_each_change(served):
    seen: queue.Queue = queue.Queue()
    channel = grpc.insecure_channel(served.grpc_target)
    call = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service="kvrelay.v1.KVRelay"))

    def read():
        try:
            for reply in call:
                seen.put(reply.status)
        except grpc.RpcError:
            pass

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert seen.get(timeout=5) == SERVING
        served.backend.no_replica = True
        assert seen.get(timeout=5) == NOT_SERVING
        served.backend.no_replica = False
        assert seen.get(timeout=5) == SERVING
    finally:
        call.cancel()
        channel.close()
        reader.join(5)


def test_a_stopped_frontend_reports_not_serving():
    server = ServedFrontends(EchoBackend(), health_interval_s=0.05)
    try:
        assert grpc_health(server) == {s: SERVING for s in SERVICES}
        server.call(server.frontends.grpc.health.stop())
        assert grpc_health(server) == {s: NOT_SERVING for s in SERVICES}
    finally:
        server.close()


def test_unhealthy_reason_is_the_rule_for_both():
    alive = lambda rid, stage, ok: ReplicaStatus(rid, stage, ok)  # noqa: E731
    assert unhealthy_reason(ClusterStatus("m", "disaggregated")) == "no replicas"
    assert unhealthy_reason(ClusterStatus("m", "disaggregated", (
        alive("p0", Stage.PREFILL, True), alive("d0", Stage.DECODE, False), alive("d1", Stage.DECODE, True)))) is None
    assert unhealthy_reason(ClusterStatus("m", "disaggregated", (
        alive("p0", Stage.PREFILL, True), alive("d0", Stage.DECODE, False)))) == "no live replica of stage decode"


def _reflect(channel, method: str, request: reflection_pb2.ServerReflectionRequest):
    call = channel.stream_stream(method, request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                                 response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)
    (reply,) = list(call(iter([request]), timeout=5))
    return reply


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
def test_reflection_lists_and_describes_the_services(served, version):
    method = f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo"
    with grpc.insecure_channel(served.grpc_target) as channel:
        listed = _reflect(channel, method, reflection_pb2.ServerReflectionRequest(list_services=""))
        names = {s.name for s in listed.list_services_response.service}
        assert {"kvrelay.v1.KVRelay", "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection",
                "grpc.reflection.v1alpha.ServerReflection"} <= names
        for symbol in ("kvrelay.v1.KVRelay", "grpc.reflection.v1.ServerReflection"):
            described = _reflect(channel, method, reflection_pb2.ServerReflectionRequest(
                file_containing_symbol=symbol))
            assert described.WhichOneof("message_response") == "file_descriptor_response", symbol
    if version == "v1alpha":  # grpcio-reflection's own client
        with grpc.insecure_channel(served.grpc_target) as channel:
            db = ProtoReflectionDescriptorDatabase(channel)
            assert "kvrelay.v1.KVRelay" in db.get_services()
            assert db.FindFileContainingSymbol("kvrelay.v1.KVRelay").package == "kvrelay.v1"
    assert json.loads(served.get("/health")[1])["status"] == "ok"


def test_stop_is_bounded_when_grpc_never_confirms(monkeypatch):
    """gRPC's own stop waiting forever on the core's confirmation must not hang the frontend's stop."""
    from cluster import grpc_frontend

    monkeypatch.setattr(grpc_frontend, "STOP_CONFIRM_S", 0.3)
    server = ServedFrontends(EchoBackend(), health_interval_s=0.05)
    grpc_server = server.frontends.grpc.server
    real_stop = grpc_server.stop

    async def never_confirms(grace):
        await real_stop(grace)
        await asyncio.Event().wait()

    grpc_server.stop = never_confirms
    t0 = time.monotonic()
    server.close()
    assert time.monotonic() - t0 < 5.0
    assert server.frontends.grpc.server is None
    with grpc.insecure_channel(server.grpc_target) as channel, pytest.raises(grpc.RpcError):
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1)


def test_stop_ends_a_follower_that_lost_its_cancel():
    """A follower that goes on after its cancel (as one in asyncio.wait_for could, before 3.12) still stops."""
    server = ServedFrontends(EchoBackend(), health_interval_s=0.01)
    health = server.frontends.grpc.health
    lost, entered = [], []

    async def loses_a_cancel():
        entered.append(True)
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            if lost:
                raise
            lost.append(True)  # the first is swallowed: the follower runs on

    try:
        health.poll_once = loses_a_cancel
        wait_until(lambda: entered)  # the follower is in loses_a_cancel, where the next cancel lands
        t0 = time.monotonic()
        server.call(health.stop(), timeout=30)
        assert time.monotonic() - t0 < 4.0
        assert health._task is None
        assert lost == [True]
    finally:
        server.close()
