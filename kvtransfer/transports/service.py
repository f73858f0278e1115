"""The receiver's gRPC service (transports `grpc` and `nccl`): protobuf stops here."""
from __future__ import annotations

import contextlib
import datetime
import socket
import uuid
from concurrent import futures

import grpc
from google.protobuf.message import DecodeError

from kvtransfer.config import ReceiverConfig
from kvtransfer.receiver_core import ReceiverCore
from kvtransfer.transports import heap, pairing
from kvtransfer.types import Ack, HandshakeError, PlanError
from protos import kvtransfer_pb2 as pb
from protos import kvtransfer_pb2_grpc as pb_grpc

SERVICE_NAME = "kvrelay.kvtransfer.KVTransfer"
SESSION_KEY = "kvt-session"
MAX_MESSAGE_BYTES = 256 << 20


def grpc_options() -> list[tuple[str, int]]:
    """Large messages in large HTTP/2 frames, with a window that does not throttle a loopback link."""
    return [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.http2.max_frame_size", (16 << 20) - 1),
            ("grpc.http2.lookahead_bytes", 64 << 20),
            ("grpc.http2.bdp_probe", 0)]


def _varint(buf: memoryview, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = buf[i]
        i += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, i
        shift += 7


def split_chunk(raw: bytes) -> tuple[pb.Chunk, memoryview]:
    """Parse a Chunk but leave its data (field 15) as a view of the received bytes: no copy.

    Raises ValueError on bytes that are not a Chunk (a truncated field, a bad wire type).
    """
    try:
        return _split_chunk(raw)
    except (IndexError, DecodeError) as e:
        raise ValueError(f"not a Chunk message ({len(raw)} bytes): {e}") from None


def _split_chunk(raw: bytes) -> tuple[pb.Chunk, memoryview]:
    buf = memoryview(raw)
    i = 0
    while i < len(buf):
        key_at = i
        key, i = _varint(buf, i)
        field, wire_type = key >> 3, key & 7
        if wire_type == 0:
            _, i = _varint(buf, i)
        elif wire_type == 1:
            i += 8
        elif wire_type == 5:
            i += 4
        elif wire_type == 2:
            n, i = _varint(buf, i)
            if i + n > len(buf):
                raise ValueError(f"field {field} claims {n} bytes, {len(buf) - i} left")
            if field == 15:
                header = pb.Chunk.FromString(bytes(buf[:key_at]) + bytes(buf[i + n:]))
                return header, buf[i:i + n]
            i += n
        else:
            raise ValueError(f"bad wire type {wire_type}")
        if i > len(buf):
            raise ValueError("truncated field")
    return pb.Chunk.FromString(raw), memoryview(b"")


def peer_host(peer: str) -> str:
    """gRPC's ``ipv4:10.0.0.2:5123`` / ``ipv6:[::1]:5123`` without the port: one peer however many sockets."""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        return rest.rsplit(":", 1)[0]
    return peer


def to_pb(ack: Ack) -> pb.Ack:
    return pb.Ack(ok=ack.ok, dropped=ack.dropped, error=ack.error)


class KVTransferServicer(pb_grpc.KVTransferServicer):
    def __init__(self, core: ReceiverCore, transport: str, host: str, chunk_timeout_s: float):
        self.core = core
        self.transport = transport
        self.host = host
        self.chunk_timeout_s = chunk_timeout_s
        self.store = pairing.host_store(host, chunk_timeout_s) if transport == "nccl" else None
        self.staging = pairing.StagingBuffers(core.device)

    def _session(self, context):
        for key, value in context.invocation_metadata():
            if key == SESSION_KEY:
                session = self.core.session(value)
                if session is not None:
                    return session
        context.abort(grpc.StatusCode.UNAUTHENTICATED, "no valid session: handshake first")

    def Hello(self, request, context):
        try:
            return pb.HelloReply(nonce=self.core.hello(peer_host(context.peer())))
        except HandshakeError as e:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))

    def Handshake(self, request, context):
        if request.transport != self.transport:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"handshake refused: receiver speaks {self.transport!r}, sender {request.transport!r}")
        try:
            session, proof = self.core.handshake(request.nonce, request.proof, request.sender_nonce,
                                                 dict(request.fingerprint), request.transport)
        except HandshakeError as e:
            code = (grpc.StatusCode.FAILED_PRECONDITION if "fingerprint" in str(e) or isinstance(e, PlanError)
                    else grpc.StatusCode.PERMISSION_DENIED)
            context.abort(code, str(e))
        reply = pb.HandshakeReply(session_id=session.session_id, proof=proof, fingerprint=self.core.fingerprint)
        if self.transport == "nccl":
            backend = pairing.backend_for(self.core.device)
            pair = pairing.PairGroup(backend)
            pair_id = uuid.uuid4().hex
            pair.build_async(self.store, pair_id, pairing.RECEIVER_RANK, self.host, self.chunk_timeout_s)
            session.pair = pair
            reply.store_host, reply.store_port = self.host, self.store.port
            reply.pair_id, reply.backend = pair_id, backend
        return reply

    def Renew(self, request, context):
        self._session(context)
        return to_pb(self.core.renew(request.transfer_id, request.lease_s))

    def Push(self, requests, context):
        """A stream of Chunks kept as raw bytes until here, so that malformed bytes get a clear Ack, not INTERNAL.

        One Ack per Chunk, in order. The session is checked per chunk: a session dropped meanwhile ends the stream.
        """
        session_id = self._session(context).session_id
        for raw in requests:
            if self.core.session(session_id) is None:
                context.abort(grpc.StatusCode.UNAUTHENTICATED, "session ended: handshake again")
            yield self._push(raw)

    def _push(self, raw: bytes) -> pb.Ack:
        try:
            header, data = split_chunk(raw)
        except ValueError as e:
            return pb.Ack(ok=False, error=f"malformed chunk: {e}")
        crc = header.crc32 if header.has_checksum else None
        return to_pb(self.core.write_chunk(header.transfer_id, header.layer, header.first_block,
                                           header.num_blocks, data, crc, header.num_layers,
                                           header.head_start, header.num_heads))

    def Announce(self, request, context):
        session = self._session(context)
        pair = session.pair
        expected = self.core.chunk_nbytes(request.num_layers, request.num_blocks, request.num_heads)
        if pair is None or request.nbytes != expected or expected <= 0 or request.num_heads < 0:
            self.core.fail(request.transfer_id, f"bad announce: {request.nbytes} bytes, expected {expected}")
            return pb.Ack(ok=False, error="bad announce")
        staging = self.staging.take(expected)  # [nbytes]
        try:
            group = pair.wait_ready(self.chunk_timeout_s)
            # one message a layer, tags tag, tag + 1, ... (or one in all: pairing.num_parts), into its slice
            parts = staging.view(pairing.num_parts(expected, request.num_layers), -1)
            works = [group.recv([part], pairing.SENDER_RANK, request.tag + i) for i, part in enumerate(parts)]
            for work in works:
                work.wait(datetime.timedelta(seconds=self.chunk_timeout_s))
        except Exception as e:  # the sender died or stalled: this pair is done (the buffer is not reused)
            pair.is_broken = True
            self.core.drop_session(session.session_id)  # its next call must handshake a new pair
            self.core.fail(request.transfer_id, f"sender lost: {str(e).splitlines()[0][:200]}")
            return pb.Ack(ok=False, error=f"sender lost: {str(e).splitlines()[0][:200]}")
        crc = request.crc32 if request.has_checksum else None
        try:
            return to_pb(self.core.write_chunk(request.transfer_id, request.layer, request.first_block,
                                               request.num_blocks, staging, crc, request.num_layers,
                                               request.head_start, request.num_heads))
        finally:
            self.staging.give(staging)

    def Commit(self, request, context):
        self._session(context)
        return to_pb(self.core.commit(request.transfer_id, request.first_token))

    def Abort(self, request, context):
        self._session(context)
        return to_pb(self.core.abort(request.transfer_id, request.reason))


def method_handlers(servicer: KVTransferServicer):
    """The service's handlers; Push gets raw bytes and keeps the data as a view (split_chunk), no parsed copy."""
    def unary(fn, deserializer):
        return grpc.unary_unary_rpc_method_handler(fn, request_deserializer=deserializer,
                                                   response_serializer=pb.Ack.SerializeToString)

    handlers = {
        "Hello": grpc.unary_unary_rpc_method_handler(servicer.Hello, pb.HelloRequest.FromString,
                                                     pb.HelloReply.SerializeToString),
        "Handshake": grpc.unary_unary_rpc_method_handler(servicer.Handshake, pb.HandshakeRequest.FromString,
                                                         pb.HandshakeReply.SerializeToString),
        "Renew": unary(servicer.Renew, pb.RenewRequest.FromString),
        "Push": grpc.stream_stream_rpc_method_handler(servicer.Push, request_deserializer=None,
                                                      response_serializer=pb.Ack.SerializeToString),
        "Announce": unary(servicer.Announce, pb.Chunk.FromString),
        "Commit": unary(servicer.Commit, pb.CommitRequest.FromString),
        "Abort": unary(servicer.Abort, pb.AbortRequest.FromString),
    }
    return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)


def advertised_host(host: str) -> str:
    """The address peers dial: the bind address, or this machine's address when binding to all."""
    if host in ("", "0.0.0.0", "::", "[::]"):
        return node_address()
    return host


def node_address() -> str:
    """This node's own address: the one its default route leaves by (no packet is sent), else its name's."""
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("10.254.254.254", 1))  # any routable address: connecting a UDP socket only picks a route
        return probe.getsockname()[0]
    return socket.gethostbyname(socket.gethostname())


def serve(core: ReceiverCore, config: ReceiverConfig):
    """Start the service (``config.transport``: grpc or nccl) on ``config.host``; returns (server, endpoint).

    The port is ``config.port`` (0: any free one), or the first free one from
    ``config.port`` to ``config.port_max``. A host of None is this node's own
    address (`node_address`). The endpoint names ``config.advertise_host``,
    or else the address peers dial (``advertised_host``).
    """
    heap.keep_large_buffers()
    host = node_address() if config.host is None else config.host
    public = config.advertise_host or advertised_host(host)
    servicer = KVTransferServicer(core, config.transport, public, config.chunk_timeout_s)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=config.max_workers, thread_name_prefix="kvt-rx"),
                         options=grpc_options() + [("grpc.so_reuseport", 0)])
    server.add_generic_rpc_handlers((method_handlers(servicer),))
    bound = _bind(server, host, config.port, config.port_max)
    server.start()
    return server, f"{config.transport}://{public}:{bound}"


def _bind(server: grpc.Server, host: str, first: int, last: int | None) -> int:
    """Listen on the first free port in [first, last] (or on ``first`` alone); the port bound."""
    address = f"[{host}]" if ":" in host else host
    for port in range(first, (first if last is None else last) + 1):
        try:
            bound = server.add_insecure_port(f"{address}:{port}")
        except RuntimeError:  # grpcio raises where older versions returned 0
            bound = 0
        if bound:
            return bound
    where = f"port {first}" if last is None or last == first else f"any port in {first}-{last}"
    raise OSError(f"KV receiver: cannot listen on {host}, {where} (in use, or not this host's address)")
