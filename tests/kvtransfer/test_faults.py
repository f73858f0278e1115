"""Every transfer ends DONE or FAILED in bounded time, and no late write touches a block."""
from __future__ import annotations

import os
import signal
import time
import zlib

import grpc
import pytest
import torch

from engine.block_pool import BlockPool, NoFreeBlocksError
from engine.kv_cache import allocate_kv_cache
from kvtransfer import HandshakeError, KVReceiver, KVSender, transports
from kvtransfer.config import GrpcLinkConfig, ReceiverConfig, SenderConfig
from kvtransfer.planner import ChunkPlan
from kvtransfer.slabs import rank_views
from kvtransfer.types import State
from protos import kvtransfer_pb2 as pb
from protos import kvtransfer_pb2_grpc as pb_grpc
from tests.kvtransfer.factories import (NUM_BLOCKS, SECRET, kill, make_fingerprint, make_source, make_spec,
                                        receiver_peer, sender_peer, spawn, wait_results)

ALL = ["grpc", "nccl", "local"]
NETWORK = ["grpc", "nccl"]


@pytest.fixture
def receiver(request):
    """A receiver in this process; the test asserts its pool is fully free at the end."""
    made = []

    def make(transport, dtype="bfloat16", **fields):  # fields: ReceiverConfig's
        spec = make_spec(dtype)
        pool = BlockPool(NUM_BLOCKS)
        rx = KVReceiver(allocate_kv_cache(spec, NUM_BLOCKS), pool, make_fingerprint(spec),
                        ReceiverConfig(SECRET, transport, **fields))
        made.append(rx)
        return rx, spec

    yield make
    for rx in made:
        rx.close()


def fill_until(predicate, timeout_s: float = 10.0) -> bool:
    end = time.time() + timeout_s
    while time.time() < end:
        if predicate():
            return True
        time.sleep(0.01)
    return False


@pytest.mark.parametrize("transport", NETWORK)
def test_sender_killed_mid_transfer_frees_blocks_within_lease(receiver, transport):
    lease_s, progress_s = 2.0, 1.0
    rx, spec = receiver(transport, progress_timeout_s=progress_s)
    proc, conn, _ = spawn(sender_peer, "bfloat16", 1, SenderConfig(SECRET))
    tickets = [rx.reserve(f"r{i}", 40, lease_s=lease_s) for i in range(3)]
    conn.send(("send", tickets, [40] * 3, 1))
    assert conn.recv()[0] == "stalled"
    inbound = rx.core.ledger.for_request("r0")
    assert fill_until(lambda: inbound.state == State.TRANSFERRING)
    kill(proc)
    killed_at = time.time()
    results = wait_results(rx, count=3, timeout_s=lease_s + progress_s + 3)
    assert [r.status for r in results] == ["FAILED"] * 3
    assert time.time() - killed_at <= lease_s + progress_s + 2.0  # slack for a loaded CI machine
    assert rx.pool.is_fully_free()


@pytest.mark.parametrize("transport", NETWORK)
def test_receiver_killed_sender_fails_within_deadline(transport):
    proc, conn, _ = spawn(receiver_peer, "bfloat16", ReceiverConfig(SECRET, transport))
    spec = make_spec("bfloat16")
    kv, pool = make_source(spec, 2), BlockPool(NUM_BLOCKS)
    deadline_s = 4.0
    tx = KVSender(make_fingerprint(spec), SenderConfig(SECRET, deadline_s=deadline_s, chunk_timeout_s=2.0))
    tickets, src = [], {}
    for i in range(4):
        conn.send(("reserve", f"r{i}", 50, 30.0))
        tickets.append(conn.recv())
        src[f"r{i}"] = pool.allocate(len(tickets[-1].block_ids))
        tx.start(tickets[-1], kv, src[f"r{i}"], 50)
        tx.push_layer(f"r{i}", 0)
    time.sleep(0.3)
    kill(proc)
    started = time.time()
    for t in tickets:
        for layer in range(1, spec.num_layers):
            tx.push_layer(t.request_id, layer)
        tx.commit(t.request_id, 5)
    results = wait_results(tx, count=4, timeout_s=deadline_s + 2)
    assert [r.status for r in results] == ["FAILED"] * 4
    assert time.time() - started <= deadline_s + 1.5
    for r in results:
        pool.free(src[r.request_id])
    tx.close()
    assert pool.is_fully_free()


def test_stuck_receiver_fails_the_chunk_within_its_timeout_and_the_link_is_replaced():
    """A receiver that stops answering (SIGSTOP: its socket stays open) fails the send after chunk_timeout_s,
    long before the transfer's deadline; once it answers again, the next transfer opens a fresh link."""
    proc, conn, _ = spawn(receiver_peer, "bfloat16", ReceiverConfig(SECRET, "grpc"))
    spec = make_spec("bfloat16")
    kv, pool = make_source(spec, 3), BlockPool(NUM_BLOCKS)
    tx = KVSender(make_fingerprint(spec), SenderConfig(SECRET, deadline_s=60.0, chunk_timeout_s=1.5))

    tickets = {}
    for rid in ("before", "stuck", "after"):  # reserved up front: a stopped receiver answers nothing
        conn.send(("reserve", rid, 50, 30.0))
        tickets[rid] = conn.recv()

    def send(rid, commit=True):
        ticket = tickets[rid]
        src = pool.allocate(len(ticket.block_ids))
        tx.start(ticket, kv, src, 50)
        for layer in range(spec.num_layers):
            tx.push_layer(rid, layer)
        if commit:
            tx.commit(rid, 7)
        return src

    try:
        src = send("before")
        [r] = wait_results(tx, count=1, timeout_s=10)
        assert r.status == "DONE"
        pool.free(src)
        os.kill(proc.pid, signal.SIGSTOP)
        started = time.time()
        src = send("stuck", commit=False)  # only chunks wait for an answer (a commit has its own timeout)
        [r] = wait_results(tx, count=1, timeout_s=10)
        assert r.status == "FAILED" and "did not acknowledge" in r.error, r.error
        assert time.time() - started <= 1.5 + 1.5  # the watchdog's period plus slack, not the 60 s deadline
        pool.free(src)
        os.kill(proc.pid, signal.SIGCONT)
        src = send("after")
        [r] = wait_results(tx, count=1, timeout_s=10)
        assert r.status == "DONE", r.error
        pool.free(src)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        tx.close()
        kill(proc)
    assert pool.is_fully_free()


def test_idle_push_streams_give_back_the_receivers_handler_threads(receiver):
    """An open Push stream holds one of the receiver's handler threads; a sender's streams close when idle, so
    a receiver with fewer threads than its senders have connections serves them all, one burst after another."""
    rx, spec = receiver("grpc", max_workers=2)
    kv, pool = make_source(spec, 4), BlockPool(NUM_BLOCKS)
    config = SenderConfig(SECRET, connect_timeout_s=5.0, chunk_timeout_s=5.0,
                          grpc=GrpcLinkConfig(num_channels=2, stream_idle_s=0.2))
    senders = [KVSender(make_fingerprint(spec), config) for _ in range(3)]
    try:
        for i, tx in enumerate(senders):
            ticket = rx.reserve(f"r{i}", 40)
            src = pool.allocate(len(ticket.block_ids))
            tx.start(ticket, kv, src, 40)
            for layer in range(spec.num_layers):
                tx.push_layer(ticket.request_id, layer)
            tx.commit(ticket.request_id, 3)
            [r] = wait_results(tx, count=1, timeout_s=15)
            assert r.status == "DONE", r.error
            pool.free(src)
            rx.pool.free(rx.release(wait_results(rx, count=1, timeout_s=5)[0].request_id))
            time.sleep(0.6)  # its streams half-close after 0.2 s idle
    finally:
        for tx in senders:
            tx.close()
    assert pool.is_fully_free() and rx.pool.is_fully_free()


@pytest.mark.parametrize("transport", ALL)
def test_wrong_secret_is_refused(receiver, transport):
    rx, spec = receiver(transport)
    tx = KVSender(make_fingerprint(spec), SenderConfig("not-the-secret"))
    with pytest.raises(HandshakeError, match="secret"):
        tx.connect(rx.endpoint)
    ticket = rx.reserve("r", 20)
    src_pool = BlockPool(8)
    src = src_pool.allocate(2)
    tx.start(ticket, allocate_kv_cache(spec, 8), src, 20)
    [result] = wait_results(tx, count=1)
    assert result.status == "FAILED" and "secret" in result.error
    src_pool.free(src)
    rx.abort("r")
    assert [r.status for r in rx.poll()] == ["FAILED"]
    tx.close()
    assert rx.pool.is_fully_free() and src_pool.is_fully_free()


@pytest.mark.parametrize("transport", ALL)
def test_fingerprint_mismatch_names_the_field(receiver, transport):
    rx, spec = receiver(transport)
    tx = KVSender(make_fingerprint(spec, num_kv_heads="4"), SenderConfig(SECRET))
    with pytest.raises(HandshakeError, match="num_kv_heads"):
        tx.connect(rx.endpoint)
    tx.close()
    assert rx.pool.is_fully_free()


def test_no_secret_no_transfer():
    spec = make_spec()
    with pytest.raises(ValueError, match="secret"):
        KVSender(make_fingerprint(spec), SenderConfig(""))
    with pytest.raises(ValueError, match="secret"):
        KVReceiver(allocate_kv_cache(spec, 4), BlockPool(4), make_fingerprint(spec), ReceiverConfig(None, "local"))


def test_calls_without_a_session_are_unauthenticated(receiver):
    rx, _ = receiver("grpc")
    with grpc.insecure_channel(rx.endpoint.split("://")[1]) as channel:
        stub = pb_grpc.KVTransferStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            next(stub.Push(iter([pb.Chunk(transfer_id="x", layer=0, num_blocks=1, data=b"\0" * 16)]), timeout=5))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert rx.pool.is_fully_free()


@pytest.mark.parametrize("transport", ALL)
def test_late_and_duplicate_chunks_after_abort_are_dropped(receiver, transport):
    rx, spec = receiver(transport)
    src_kv = make_source(spec, 5, num_blocks=8)
    src = rank_views([src_kv])
    link = transports.connect(rx.endpoint, make_fingerprint(spec), SenderConfig(SECRET.encode()))
    ticket = rx.reserve("old", 30)
    assert link.send_chunk(ticket.transfer_id, ChunkPlan(0, 0, 2), src, [3, 4], False).result(10).ok
    rx.abort("old")
    [failed] = rx.poll()
    assert failed.status == "FAILED"
    reused = rx.reserve("new", 30)  # takes the blocks the aborted transfer had
    assert set(reused.block_ids) == set(ticket.block_ids)
    before = [layer.clone() for layer in rx.core.kv_bytes[0]]
    late = [link.send_chunk(ticket.transfer_id, ChunkPlan(layer, 0, 2), src, [3, 4], False)
            for layer in (0, 1, 0)]  # a late layer 1, a duplicate layer 0
    assert all(f.result(10).dropped for f in late)
    assert link.commit(ticket.transfer_id, 1).result(10).dropped
    assert all(torch.equal(a, b) for a, b in zip(before, rx.core.kv_bytes[0]))
    link.close()
    rx.abort("new")
    rx.poll()
    assert rx.pool.is_fully_free()


def test_duplicate_chunks_after_done_are_dropped(receiver):
    rx, spec = receiver("local")
    src = rank_views([make_source(spec, 6, num_blocks=4)])
    link = transports.connect(rx.endpoint, make_fingerprint(spec), SenderConfig(SECRET.encode()))
    ticket = rx.reserve("r", 16)
    for layer in range(spec.num_layers):
        assert link.send_chunk(ticket.transfer_id, ChunkPlan(layer, 0, 1), src, [1], False).result().ok
    assert link.commit(ticket.transfer_id, 9).result().ok
    [done] = rx.poll()
    assert (done.status, done.first_token) == ("DONE", 9)
    before = [layer.clone() for layer in rx.core.kv_bytes[0]]
    assert link.send_chunk(ticket.transfer_id, ChunkPlan(0, 0, 1), src, [2], False).result().dropped  # other data
    assert all(torch.equal(a, b) for a, b in zip(before, rx.core.kv_bytes[0]))
    rx.pool.free(rx.release("r"))
    assert rx.pool.is_fully_free()


def test_expired_lease_frees_blocks_and_fails(receiver):
    rx, spec = receiver("local")
    rx.reserve("waits", 100, lease_s=0.2)
    kept = rx.reserve("renewed", 100, lease_s=0.2)
    rx.renew("renewed", 30.0)
    time.sleep(0.3)
    [expired] = rx.poll()
    assert (expired.request_id, expired.status, expired.error) == ("waits", "FAILED", "lease expired")
    assert rx.pool.num_used_blocks == len(kept.block_ids)
    rx.abort("renewed")
    rx.poll()
    assert rx.pool.is_fully_free()


def test_sender_renews_the_lease_remotely(receiver):
    rx, spec = receiver("grpc")
    ticket = rx.reserve("r", 10, lease_s=5.0)
    tx = KVSender(make_fingerprint(spec), SenderConfig(SECRET))
    tx.renew(ticket, 30.0)
    assert fill_until(lambda: rx.core.ledger.for_request("r").deadline > time.time() + 10)
    tx.close()
    rx.abort("r")
    rx.poll()
    assert rx.pool.is_fully_free()


def test_commit_without_every_layer_fails_at_the_lease(receiver):
    rx, spec = receiver("local", progress_timeout_s=1.0)
    src = rank_views([make_source(spec, 6, num_blocks=4)])
    link = transports.connect(rx.endpoint, make_fingerprint(spec), SenderConfig(SECRET.encode()))
    ticket = rx.reserve("r", 16, lease_s=1.0)
    assert link.send_chunk(ticket.transfer_id, ChunkPlan(0, 0, 1), src, [1], False).result().ok
    assert link.commit(ticket.transfer_id, 1).result().ok  # accepted, waits for the other layers
    assert rx.poll() == []
    time.sleep(1.2)
    [failed] = rx.poll()
    assert (failed.status, failed.error, failed.first_token) == ("FAILED", "lease expired", None)
    assert rx.pool.is_fully_free()


def test_commit_may_overtake_the_last_chunk(receiver):
    rx, spec = receiver("local")
    src = rank_views([make_source(spec, 6, num_blocks=4)])
    link = transports.connect(rx.endpoint, make_fingerprint(spec), SenderConfig(SECRET.encode()))
    ticket = rx.reserve("r", 16)
    last = ChunkPlan(spec.num_layers - 1, 0, 1)
    assert link.send_chunk(ticket.transfer_id, ChunkPlan(0, 0, 1, spec.num_layers - 1), src, [1], False).result().ok
    assert link.commit(ticket.transfer_id, 4).result().ok
    assert rx.poll() == []
    assert link.send_chunk(ticket.transfer_id, last, src, [1], False).result().ok
    [done] = rx.poll()
    assert (done.status, done.first_token) == ("DONE", 4)
    rx.pool.free(rx.release("r"))
    assert rx.pool.is_fully_free()


def test_checksum_mismatch_fails_the_transfer(receiver):
    rx, spec = receiver("grpc")
    link = transports.connect(rx.endpoint, make_fingerprint(spec), SenderConfig(SECRET.encode()))
    ticket = rx.reserve("r", 16)
    data = bytes(rx.core.slab_bytes)
    chunk = pb.Chunk(transfer_id=ticket.transfer_id, layer=0, first_block=0, num_blocks=1, nbytes=len(data),
                     has_checksum=True, crc32=zlib.crc32(data) ^ 1, data=data)
    [ack] = link.stub.Push(iter([chunk]), metadata=link.metadata, timeout=10)
    assert not ack.ok and "checksum" in ack.error
    link.close()
    assert [r.status for r in rx.poll()] == ["FAILED"]
    assert rx.pool.is_fully_free()


def test_malformed_push_bytes_are_refused_and_touch_no_block(receiver):
    rx, spec = receiver("grpc")
    link = transports.connect(rx.endpoint, make_fingerprint(spec), SenderConfig(SECRET.encode()))
    push = link.channel.stream_stream("/kvrelay.kvtransfer.KVTransfer/Push", request_serializer=None,
                                      response_deserializer=pb.Ack.FromString)
    ticket = rx.reserve("r", 16)
    header = pb.Chunk(transfer_id=ticket.transfer_id, layer=0, first_block=0, num_blocks=1,
                      nbytes=rx.core.slab_bytes).SerializeToString()
    before = [layer.clone() for layer in rx.core.kv_bytes[0]]
    frames = [b"\xff\xff\xff",  # a varint that never ends
              header + bytes([15 << 3 | 2]) + b"\x80\x80\x04" + b"\0" * 10,  # data claims 64 KiB, has 10 bytes
              header + bytes([15 << 3 | 7])]  # wire type 7 does not exist
    acks = list(push(iter(frames), metadata=link.metadata, timeout=10))  # one stream: it goes on after each
    assert len(acks) == len(frames)
    for ack in acks:
        assert not ack.ok and ack.error.startswith("malformed chunk:"), ack.error
    assert all(torch.equal(a, b) for a, b in zip(before, rx.core.kv_bytes[0]))
    assert rx.poll() == []  # nothing trustworthy named the transfer: it stays open for its real chunks
    link.close()
    rx.abort("r")
    assert [r.status for r in rx.poll()] == ["FAILED"]
    assert rx.pool.is_fully_free()


def test_checksummed_transfer_is_done(receiver):
    rx, spec = receiver("grpc")
    ticket = rx.reserve("r", 20)
    src_pool = BlockPool(8)
    src = src_pool.allocate(2)
    tx = KVSender(make_fingerprint(spec), SenderConfig(SECRET, checksum=True))
    tx.start(ticket, make_source(spec, 1, num_blocks=8), src, 20)
    for layer in range(spec.num_layers):
        tx.push_layer("r", layer)
    tx.commit("r", 3)
    assert [r.status for r in wait_results(tx, rx, count=2)] == ["DONE", "DONE"]
    rx.pool.free(rx.release("r"))
    src_pool.free(src)
    tx.close()
    assert rx.pool.is_fully_free() and src_pool.is_fully_free()


def test_sender_abort_reaches_the_receiver(receiver):
    rx, spec = receiver("grpc")
    ticket = rx.reserve("r", 20)
    src_pool = BlockPool(8)
    src = src_pool.allocate(2)
    tx = KVSender(make_fingerprint(spec), SenderConfig(SECRET))
    tx.start(ticket, make_source(spec, 1, num_blocks=8), src, 20)
    tx.push_layer("r", 0)
    tx.abort("r")
    [sent] = wait_results(tx, count=1)
    [received] = wait_results(rx, count=1)
    assert sent.status == received.status == "FAILED"
    src_pool.free(src)
    tx.close()
    assert rx.pool.is_fully_free() and src_pool.is_fully_free()


def test_reserve_without_free_blocks_raises(receiver):
    rx, _ = receiver("local")
    with pytest.raises(NoFreeBlocksError):
        rx.reserve("huge", 16 * (NUM_BLOCKS + 1))
    assert rx.pool.is_fully_free()


def test_hook_calls_after_a_failed_send_are_ignored(receiver):
    rx, spec = receiver("local")
    src_pool = BlockPool(8)
    src = src_pool.allocate(2)
    tx = KVSender(make_fingerprint(spec), SenderConfig(SECRET, deadline_s=0.0))
    tx.start(rx.reserve("r", 20), make_source(spec, 1, num_blocks=8), src, 20)
    [failed] = wait_results(tx, count=1)
    assert failed.status == "FAILED" and "deadline" in failed.error
    tx.hook("r")(0)  # the engine's forward pass may still be running: must not raise
    tx.commit("r", 1)
    src_pool.free(src)
    [received] = wait_results(rx, count=1, timeout_s=5)  # the abort reached the receiver (lease: 30 s)
    assert received.status == "FAILED"
    tx.close()
    assert rx.pool.is_fully_free() and src_pool.is_fully_free()


@pytest.mark.parametrize("transport", NETWORK)
def test_a_link_closed_under_the_sender_is_replaced_on_the_next_transfer(receiver, transport):
    """A link that was closed (its connection cut) is never reused: the next
    transfer to the same receiver opens a new one and is DONE."""
    rx, spec = receiver(transport)
    src_pool = BlockPool(8)
    src_kv = make_source(spec, 3, num_blocks=8)
    tx = KVSender(make_fingerprint(spec), SenderConfig(SECRET))

    def transfer(rid):
        ticket = rx.reserve(rid, 20)
        src = src_pool.allocate(2)
        tx.start(ticket, src_kv, src, 20)
        for layer in range(spec.num_layers):
            tx.push_layer(rid, layer)
        tx.commit(rid, 5)
        [sent] = wait_results(tx, count=1)
        [received] = wait_results(rx, count=1)
        src_pool.free(src)
        if received.status == "DONE":
            rx.pool.free(rx.release(rid))
        return sent.status, received.status

    assert transfer("a") == ("DONE", "DONE")
    for link in list(tx._links.values()):
        link.close()  # the connection goes away under the sender
    assert transfer("b") == ("DONE", "DONE")
    tx.close()
    assert rx.pool.is_fully_free() and src_pool.is_fully_free()
