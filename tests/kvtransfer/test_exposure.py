"""What an unauthenticated peer can do to a receiver: little. And where the receiver listens."""
from __future__ import annotations

import socket

import grpc
import pytest

from engine.block_pool import BlockPool
from engine.kv_cache import allocate_kv_cache
from kvtransfer import HandshakeError, KVReceiver, KVSender
from kvtransfer import receiver_core
from kvtransfer.auth import sender_proof
from kvtransfer.config import ReceiverConfig, SenderConfig
from kvtransfer.transports.service import node_address, peer_host
from protos import kvtransfer_pb2 as pb
from protos import kvtransfer_pb2_grpc as pb_grpc
from tests.kvtransfer.factories import NUM_BLOCKS, SECRET, make_fingerprint, make_spec


@pytest.fixture
def receiver():
    made = []

    def make(transport="grpc", **fields):
        spec = make_spec()
        rx = KVReceiver(allocate_kv_cache(spec, NUM_BLOCKS), BlockPool(NUM_BLOCKS), make_fingerprint(spec),
                        ReceiverConfig(SECRET, transport, **fields))
        made.append(rx)
        return rx, spec

    yield make
    for rx in made:
        assert rx.pool.is_fully_free()
        rx.close()


def handshake(core, nonce: bytes, spec) -> None:
    sender_nonce = b"s" * 16
    core.handshake(nonce, sender_proof(SECRET.encode(), nonce, sender_nonce), sender_nonce, make_fingerprint(spec),
                   "grpc")


def test_a_peers_pending_nonces_are_capped_and_its_oldest_pushed_out(receiver):
    rx, spec = receiver()
    core = rx.core
    nonces = [core.hello("10.0.0.9") for _ in range(receiver_core.MAX_NONCES_PER_PEER * 3)]
    assert core.num_pending_nonces == receiver_core.MAX_NONCES_PER_PEER
    with pytest.raises(HandshakeError, match="unknown or stale nonce"):
        handshake(core, nonces[0], spec)  # pushed out
    handshake(core, nonces[-1], spec)  # the newest still answers
    assert core.num_pending_nonces == receiver_core.MAX_NONCES_PER_PEER - 1
    other = core.hello("10.0.0.10")  # another peer is not pushed out by the first one
    for _ in range(receiver_core.MAX_NONCES_PER_PEER * 2):
        core.hello("10.0.0.9")
    handshake(core, other, spec)


def test_pending_nonces_are_capped_in_total(receiver, monkeypatch):
    monkeypatch.setattr(receiver_core, "MAX_NONCES", 200)
    rx, spec = receiver()
    core = rx.core
    first = core.hello("peer-0")
    for i in range(1, 200):
        core.hello(f"peer-{i}")
    with pytest.raises(HandshakeError, match="handshakes pending"):
        core.hello("peer-new")
    assert core.num_pending_nonces == 200
    handshake(core, first, spec)  # one used: room for one more
    core.hello("peer-new")
    assert core.num_pending_nonces == 200


def test_nonces_expire(receiver, monkeypatch):
    rx, spec = receiver()
    core = rx.core
    old = core.hello("10.0.0.9")
    now = receiver_core.time.time()
    monkeypatch.setattr(receiver_core.time, "time", lambda: now + 31.0)
    core.hello("10.0.0.11")
    assert core.num_pending_nonces == 1
    with pytest.raises(HandshakeError, match="unknown or stale nonce"):
        handshake(core, old, spec)


def test_hello_over_grpc_is_capped_per_peer_address(receiver):
    rx, _ = receiver()
    target = rx.endpoint.split("://")[1]
    for _ in range(3):  # three connections from one host are one peer
        with grpc.insecure_channel(target) as channel:
            stub = pb_grpc.KVTransferStub(channel)
            for _ in range(receiver_core.MAX_NONCES_PER_PEER):
                stub.Hello(pb.HelloRequest(), timeout=5)
    assert rx.core.num_pending_nonces == receiver_core.MAX_NONCES_PER_PEER


def test_peer_host_drops_the_port():
    assert peer_host("ipv4:10.0.0.2:5123") == "10.0.0.2"
    assert peer_host("ipv6:[::1]:5123") == "[::1]"
    assert peer_host("unix:/tmp/sock") == "unix:/tmp/sock"


def _free_ports(n: int) -> int:
    """The first of ``n`` consecutive ports that are free now."""
    for first in range(31000, 60000, n):
        socks = []
        try:
            for port in range(first, first + n):
                s = socket.socket()
                s.bind(("127.0.0.1", port))
                socks.append(s)
            return first
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port range")


def test_receivers_take_the_first_free_ports_of_their_range_and_refuse_a_full_one(receiver):
    first = _free_ports(2)
    a, _ = receiver(port=first, port_max=first + 1)
    b, spec = receiver(port=first, port_max=first + 1)
    ports = sorted(int(rx.endpoint.rsplit(":", 1)[1]) for rx in (a, b))
    assert ports == [first, first + 1]  # two receivers never share a port (no SO_REUSEPORT)
    with pytest.raises(OSError, match=f"any port in {first}-{first + 1}"):
        KVReceiver(allocate_kv_cache(spec, 4), BlockPool(4), make_fingerprint(spec),
                   ReceiverConfig(SECRET, "grpc", port=first, port_max=first + 1))
    tx = KVSender(make_fingerprint(spec), SenderConfig("not-the-secret"))  # and each refuses a peer without it
    for rx in (a, b):
        with pytest.raises(HandshakeError, match="secret"):
            tx.connect(rx.endpoint)
    tx.close()


def test_host_none_is_this_nodes_own_address(receiver):
    rx, _ = receiver(host=None)
    host = rx.endpoint.split("://")[1].rsplit(":", 1)[0]
    assert host == node_address() and host not in ("0.0.0.0", "")
