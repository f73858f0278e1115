"""The `grpc` transport: KV bytes ride in unary Push calls, round-robin over ``num_channels`` connections.

Messages are sized by the planner (``max_chunk_bytes``), and at most
``window`` chunks are in flight per link (HTTP/2 adds its own flow control
underneath). A Push is encoded by hand as valid protobuf: the small header
fields, then field 15 (data) whose bytes are joined straight from the source
slabs; the receiver parses the header and keeps the data as a view. What
grpcio adds is one copy per side (bytes into its slice; slices into the
bytes handed to the handler). Starting a call does that copy and the first
socket write in the calling thread, so each connection has its own starting
thread and the sender's worker goes on to join the next chunk.
"""
from __future__ import annotations

import itertools
import threading
import zlib
from concurrent.futures import Future, ThreadPoolExecutor

import grpc
import torch

from kvtransfer import auth
from kvtransfer.planner import ChunkPlan
from kvtransfer.receiver import Ack
from kvtransfer.transports import heap
from kvtransfer.transports.base import Link, chunk_ids, done, gather, pieces
from kvtransfer.transports.service import SESSION_KEY, grpc_options
from kvtransfer.types import HandshakeError, TransferError
from protos import kvtransfer_pb2 as pb
from protos import kvtransfer_pb2_grpc as pb_grpc

_DATA_TAG = bytes([(15 << 3) | 2])  # field 15, length-delimited
_SERVICE = "/kvrelay.kvtransfer.KVTransfer/"


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

    def __init__(self, endpoint: str, channel: grpc.Channel, session_id: str, chunk_timeout_s: float):
        self.endpoint = endpoint
        self.channel = channel
        self.stub = pb_grpc.KVTransferStub(channel)
        self.metadata = ((SESSION_KEY, session_id),)
        self.chunk_timeout_s = chunk_timeout_s

    @classmethod
    def _handshake(cls, endpoint, fingerprint, secret, timeout_s):
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
        self.channel.close()


class GrpcLink(GrpcControl):
    """Pushes round-robin over ``num_channels`` connections (each its own TCP socket and gRPC I/O)."""

    transport = "grpc"

    def __init__(self, *args, window: int = 16, num_channels: int = 2, **kwargs):
        super().__init__(*args, **kwargs)
        address = self.endpoint.split("://", 1)[1]
        self._data_channels = [grpc.insecure_channel(address, options=grpc_options() + [
            ("grpc.use_local_subchannel_pool", 1)]) for _ in range(max(1, num_channels))]
        self._pushes = [c.unary_unary(_SERVICE + "Push", request_serializer=None,
                                      response_deserializer=pb.Ack.FromString) for c in self._data_channels]
        # Starting a call copies the message into gRPC and writes what the socket takes, in the
        # caller's thread: one thread per connection lets the connections write in parallel.
        self._issuers = [ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvt-push")
                         for _ in self._data_channels]
        self._next = itertools.count()
        self._window = threading.Semaphore(window)

    @classmethod
    def connect(cls, endpoint, fingerprint, secret, timeout_s, chunk_timeout_s: float = 30.0, window: int = 16,
                num_channels: int = 2, **options):
        channel, reply = cls._handshake(endpoint, fingerprint, secret, timeout_s)
        heap.keep_large_buffers()
        return cls(endpoint, channel, reply.session_id, chunk_timeout_s, window=window, num_channels=num_channels)

    def close(self) -> None:
        for issuer in self._issuers:
            issuer.shutdown(wait=True)
        for c in self._data_channels:
            c.close()
        super().close()

    def send_chunk(self, transfer_id, chunk: ChunkPlan, src: torch.Tensor, src_block_ids, checksum):
        ids = chunk_ids(chunk, src_block_ids)
        if src[0].device.type != "cpu":
            parts = [gather(src, chunk, ids).cpu().numpy()]
        else:
            parts = pieces(src, chunk, ids)  # views, no copy
        nbytes = sum(p.nbytes for p in parts)
        header = pb.Chunk(transfer_id=transfer_id, layer=chunk.layer, first_block=chunk.first_block,
                          num_blocks=chunk.num_blocks, num_layers=chunk.num_layers,
                          nbytes=nbytes)
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
        i = next(self._next) % len(self._pushes)
        self._issuers[i].submit(self._call, self._pushes[i], message, None, out)
        return out
