"""The `grpc` transport: KV bytes ride on Push streams, round-robin over ``num_channels`` connections.

Messages are sized by the planner (``max_chunk_bytes``), and at most
``window`` chunks are in flight per link (HTTP/2 adds its own flow control
underneath). A Chunk is encoded by hand as valid protobuf: the small header
fields, then field 15 (data) whose bytes are joined straight from the source
slabs; the receiver parses the header and keeps the data as a view. What
grpcio adds is one copy on the sending side (bytes into its slice) and its
reassembly of the received slices into the bytes handed to the handler.
A stream per connection (opened on demand, closed when idle) rather than a
unary call per chunk: no call setup, metadata or handler dispatch per chunk
(BENCHMARKS.md, "Measured design choices").
"""
from __future__ import annotations

import collections
import itertools
import queue
import threading
import time
import zlib
from concurrent.futures import Future

import grpc
import torch

from kvtransfer import auth
from kvtransfer.config import SenderConfig
from kvtransfer.planner import ChunkPlan
from kvtransfer.transports import heap
from kvtransfer.transports.base import Link, chunk_ids, done, gather, pieces
from kvtransfer.transports.service import SESSION_KEY, grpc_options
from kvtransfer.types import Ack, HandshakeError, TransferError
from protos import kvtransfer_pb2 as pb
from protos import kvtransfer_pb2_grpc as pb_grpc

_DATA_TAG = bytes([(15 << 3) | 2])  # field 15, length-delimited
_SERVICE = "/kvrelay.kvtransfer.KVTransfer/"
_END = object()  # closes a Push stream's request iterator


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


class GrpcControl(Link):
    """Handshake and the small control calls, shared by the grpc and nccl links."""

    transport = "grpc"

    def __init__(self, endpoint: str, channel: grpc.Channel, session_id: str, config: SenderConfig):
        self.endpoint = endpoint
        self.channel = channel
        self.stub = pb_grpc.KVTransferStub(channel)
        self.metadata = ((SESSION_KEY, session_id),)
        self.chunk_timeout_s = config.chunk_timeout_s

    @classmethod
    def _handshake(cls, endpoint: str, fingerprint: dict[str, str], config: SenderConfig):
        secret, timeout_s = auth.as_secret(config.secret), config.connect_timeout_s
        address = endpoint.split("://", 1)[1]
        channel = grpc.insecure_channel(address, options=grpc_options())
        stub = pb_grpc.KVTransferStub(channel)
        try:
            nonce = stub.Hello(pb.HelloRequest(), timeout=timeout_s).nonce
            sender_nonce = auth.new_nonce()
            reply = stub.Handshake(pb.HandshakeRequest(
                nonce=nonce, proof=auth.sender_proof(secret, nonce, sender_nonce), sender_nonce=sender_nonce,
                fingerprint=fingerprint, transport=cls.transport), timeout=timeout_s)
        except grpc.RpcError as e:
            channel.close()
            if e.code() in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.FAILED_PRECONDITION):
                raise HandshakeError(e.details()) from None
            raise TransferError(f"cannot reach receiver {endpoint}: {e.code().name} {e.details()}") from None
        if not auth.proofs_match(reply.proof, auth.receiver_proof(secret, sender_nonce)):
            channel.close()
            raise HandshakeError("handshake refused: the receiver does not know the cluster secret")
        return channel, reply

    def _set_peer(self, reply) -> None:
        self.peer_fingerprint = dict(reply.fingerprint)

    def _call(self, method, request, timeout_s: float | None = None, out: Future | None = None) -> Future:
        out = out or Future()
        try:
            call = method.future(request, timeout=timeout_s or self.chunk_timeout_s, metadata=self.metadata)
        except Exception as e:  # e.g. the channel was closed meanwhile
            out.set_result(Ack(False, error=f"{type(e).__name__}: {e}"))
            return out

        def finish(c):
            try:
                r = c.result()
                out.set_result(Ack(r.ok, r.dropped, r.error))
            except grpc.RpcError as e:
                if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAUTHENTICATED):
                    self.is_broken = True
                out.set_result(Ack(False, error=f"{e.code().name}: {e.details()}"))

        call.add_done_callback(finish)
        return out

    def commit(self, transfer_id, first_token):
        return self._call(self.stub.Commit, pb.CommitRequest(transfer_id=transfer_id, first_token=first_token))

    def abort(self, transfer_id, reason):
        return self._call(self.stub.Abort, pb.AbortRequest(transfer_id=transfer_id, reason=reason))

    def renew(self, transfer_id, lease_s):
        return self._call(self.stub.Renew, pb.RenewRequest(transfer_id=transfer_id, lease_s=lease_s))

    def close(self) -> None:
        self.is_broken = True  # a closed link is replaced on the next transfer, never reused
        self.channel.close()


class _PushCall:
    """One Push call: its messages in order, and the futures waiting for their Acks in the same order."""

    def __init__(self, owner: "PushStream"):
        self.owner = owner
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.waiting: collections.deque[tuple[float, Future]] = collections.deque()
        self.is_closing = False  # no new message joins it (idle, or the link closes)
        self.responses = owner.method(self._requests(), metadata=owner.metadata)
        self.reader = threading.Thread(target=self._read, name=f"{owner.name}-acks", daemon=True)
        self.reader.start()

    def _requests(self):
        """What grpcio's sending thread iterates; ends (half-close) after idle_s without a message."""
        while True:
            try:
                message = self.outbox.get(timeout=self.owner.idle_s)
            except queue.Empty:
                with self.owner.lock:
                    if not self.outbox.empty():  # a message came in meanwhile: it goes on this call
                        continue
                    self.is_closing = True
                return
            if message is _END:
                return
            yield message

    def _read(self) -> None:
        error, broken = "receiver ended the stream before acknowledging every chunk", False
        try:
            for reply in self.responses:
                with self.owner.lock:
                    _, out = self.waiting.popleft()
                out.set_result(Ack(reply.ok, reply.dropped, reply.error))
        except grpc.RpcError as e:  # CANCELLED: by close() or the watchdog, which said why already
            error, broken = f"{e.code().name}: {e.details()}", e.code() != grpc.StatusCode.CANCELLED
        except Exception as e:  # an Ack nobody waited for: the receiver broke the protocol
            error, broken = f"{type(e).__name__}: {e}", True
        self.owner.ended(self, error, broken)


class PushStream:
    """Chunks to one connection, in order, on Push streams opened on demand.

    grpcio's sending thread takes the messages from a queue, copies each into
    gRPC and writes it; a reader thread resolves the oldest waiting future per
    Ack. A stream half-closes after ``idle_s`` without a chunk, so an idle
    sender holds none of the receiver's handler threads (each open stream
    holds one), and the next chunk opens a fresh stream. A stream that ends
    with chunks unanswered (a transport error, or the oldest chunk waiting
    longer than ``chunk_timeout_s``: a stuck receiver) resolves them with
    Ack(ok=False) and sets ``is_dead``: the link is replaced.
    """

    def __init__(self, method, metadata, chunk_timeout_s: float, name: str, idle_s: float = 2.0):
        self.method, self.metadata, self.name = method, metadata, name
        self.chunk_timeout_s, self.idle_s = chunk_timeout_s, idle_s
        self.is_dead = False
        self.lock = threading.Lock()
        self._error = ""
        self._current: _PushCall | None = None
        self._calls: set[_PushCall] = set()  # open or still answering
        self._stop = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name=f"{name}-watch", daemon=True)
        self._watchdog.start()

    def send(self, message: bytes, out: Future) -> None:
        with self.lock:
            if not self.is_dead:
                call = self._current
                if call is None or call.is_closing:
                    call = self._current = _PushCall(self)
                    self._calls.add(call)
                call.waiting.append((time.monotonic(), out))
                call.outbox.put(message)  # under the lock: queue order == waiting order
                return
            error = self._error
        out.set_result(Ack(False, error=error))

    def ended(self, call: _PushCall, error: str, broken: bool = False) -> None:
        """A call's responses ended; anything still waiting on it failed, and so did the link then, or when
        ``broken`` (a transport error even with nothing waiting: the next transfer reconnects)."""
        with self.lock:
            self._calls.discard(call)
            call.is_closing = True
            waiting, call.waiting = list(call.waiting), collections.deque()
            if (waiting or broken) and not self.is_dead:
                self.is_dead, self._error = True, error
        for _, out in waiting:
            out.set_result(Ack(False, error=error))

    def close(self) -> None:
        """Let open streams finish what they carry (briefly), then end them."""
        with self.lock:
            calls, self._current = list(self._calls), None
            for call in calls:
                call.is_closing = True
                call.outbox.put(_END)
        for call in calls:
            call.reader.join(timeout=min(5.0, self.chunk_timeout_s))
        self._stop.set()
        self._cancel(calls, "link closed")

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.chunk_timeout_s / 4)):
            now = time.monotonic()
            with self.lock:
                if self.is_dead and not self._calls:
                    return
                stuck = [c for c in self._calls if c.waiting and now - c.waiting[0][0] > self.chunk_timeout_s]
            self._cancel(stuck, f"DEADLINE_EXCEEDED: receiver did not acknowledge a chunk within "
                                f"{self.chunk_timeout_s}s")

    def _cancel(self, calls: list[_PushCall], error: str) -> None:
        for call in calls:
            self.ended(call, error)  # before cancel: the reader's CANCELLED must not name the cause
            call.responses.cancel()


class GrpcLink(GrpcControl):
    """Pushes round-robin over ``num_channels`` connections (each its own TCP socket and Push stream)."""

    transport = "grpc"
    _is_broken = False  # the control calls' verdict; a dead Push stream breaks the link too (is_broken)

    def __init__(self, endpoint: str, channel: grpc.Channel, session_id: str, config: SenderConfig):
        super().__init__(endpoint, channel, session_id, config)
        options = config.grpc
        address = self.endpoint.split("://", 1)[1]
        self._data_channels = [grpc.insecure_channel(address, options=grpc_options() + [
            ("grpc.use_local_subchannel_pool", 1)]) for _ in range(options.num_channels)]
        self._streams = [PushStream(c.stream_stream(_SERVICE + "Push", request_serializer=None,
                                                    response_deserializer=pb.Ack.FromString),
                                    self.metadata, self.chunk_timeout_s, name=f"kvt-push{i}",
                                    idle_s=options.stream_idle_s)
                         for i, c in enumerate(self._data_channels)]
        self._next = itertools.count()
        self._window = threading.Semaphore(options.window)

    @classmethod
    def connect(cls, endpoint: str, fingerprint: dict[str, str], config: SenderConfig) -> "GrpcLink":
        channel, reply = cls._handshake(endpoint, fingerprint, config)
        heap.keep_large_buffers()
        link = cls(endpoint, channel, reply.session_id, config)
        link._set_peer(reply)
        return link

    @property
    def is_broken(self) -> bool:
        return self._is_broken or any(s.is_dead for s in self._streams)

    @is_broken.setter
    def is_broken(self, value: bool) -> None:
        self._is_broken = value

    def close(self) -> None:
        for stream in self._streams:
            stream.close()
        for c in self._data_channels:
            c.close()
        super().close()

    def send_chunk(self, transfer_id, chunk: ChunkPlan, src: torch.Tensor, src_block_ids, checksum):
        ids = chunk_ids(chunk, src_block_ids)
        if src[chunk.src_rank][chunk.layer].device.type != "cpu":
            parts = [gather(src, chunk, ids).cpu().numpy()]
        else:
            parts = pieces(src, chunk, ids)  # views, no copy
        nbytes = sum(p.nbytes for p in parts)
        header = pb.Chunk(transfer_id=transfer_id, layer=chunk.layer, first_block=chunk.first_block,
                          num_blocks=chunk.num_blocks, num_layers=chunk.num_layers,
                          head_start=chunk.head_start, num_heads=chunk.num_heads, nbytes=nbytes)
        if checksum:
            crc = 0
            for p in parts:
                crc = zlib.crc32(p, crc)
            header.has_checksum, header.crc32 = True, crc & 0xFFFFFFFF
        message = b"".join([header.SerializeToString(), _DATA_TAG, _varint(nbytes), *parts])
        if not self._window.acquire(timeout=self.chunk_timeout_s):
            return done(Ack(False, error="flow-control window stuck: receiver not acknowledging"))
        out: Future = Future()
        out.add_done_callback(lambda _: self._window.release())
        self._streams[next(self._next) % len(self._streams)].send(message, out)
        return out
