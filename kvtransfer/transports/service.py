"""The receiver's gRPC service (transports `grpc` and `nccl`): protobuf stops here."""
from __future__ import annotations

import datetime
import uuid
from concurrent import futures

import grpc
import torch

from kvtransfer.receiver import Ack, ReceiverCore
from kvtransfer.transports import pairing
from kvtransfer.types import HandshakeError
from protos import kvtransfer_pb2 as pb
from protos import kvtransfer_pb2_grpc as pb_grpc

SESSION_KEY = "kvt-session"
MAX_MESSAGE_BYTES = 256 << 20


def grpc_options() -> list[tuple[str, int]]:
    return [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]


def to_pb(ack: Ack) -> pb.Ack:
    return pb.Ack(ok=ack.ok, dropped=ack.dropped, error=ack.error)


class KVTransferServicer(pb_grpc.KVTransferServicer):
    def __init__(self, core: ReceiverCore, transport: str, host: str, chunk_timeout_s: float):
        self.core = core
        self.transport = transport
        self.host = host
        self.chunk_timeout_s = chunk_timeout_s
        self.store = pairing.host_store(host, chunk_timeout_s) if transport == "nccl" else None
        self.pairs: list[pairing.PairGroup] = []

    def _session(self, context):
        for key, value in context.invocation_metadata():
            if key == SESSION_KEY:
                session = self.core.session(value)
                if session is not None:
                    return session
        context.abort(grpc.StatusCode.UNAUTHENTICATED, "no valid session: handshake first")

    def Hello(self, request, context):
        return pb.HelloReply(nonce=self.core.hello())

    def Handshake(self, request, context):
        if request.transport != self.transport:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"handshake refused: receiver speaks {self.transport!r}, sender {request.transport!r}")
        try:
            session, proof = self.core.handshake(request.nonce, request.proof, request.sender_nonce,
                                                 dict(request.fingerprint), request.transport)
        except HandshakeError as e:
            code = (grpc.StatusCode.FAILED_PRECONDITION if "fingerprint" in str(e)
                    else grpc.StatusCode.PERMISSION_DENIED)
            context.abort(code, str(e))
        reply = pb.HandshakeReply(session_id=session.session_id, proof=proof)
        if self.transport == "nccl":
            backend = pairing.backend_for(self.core.device)
            pair = pairing.PairGroup(backend)
            pair_id = uuid.uuid4().hex
            pair.build_async(self.store, pair_id, pairing.RECEIVER_RANK, self.host, self.chunk_timeout_s)
            session.pair = pair
            self.pairs.append(pair)
            reply.store_host, reply.store_port = self.host, self.store.port
            reply.pair_id, reply.backend = pair_id, backend
        return reply

    def Renew(self, request, context):
        self._session(context)
        return to_pb(self.core.renew(request.transfer_id, request.lease_s))

    def Push(self, request, context):
        self._session(context)
        crc = request.crc32 if request.has_checksum else None
        return to_pb(self.core.write_chunk(request.transfer_id, request.layer, request.first_block,
                                           request.num_blocks, request.data, crc))

    def Announce(self, request, context):
        session = self._session(context)
        pair = session.pair
        expected = request.num_blocks * self.core.slab_bytes
        if pair is None or request.nbytes != expected or expected <= 0:
            self.core.fail(request.transfer_id, f"bad announce: {request.nbytes} bytes, expected {expected}")
            return pb.Ack(ok=False, error="bad announce")
        staging = torch.empty(expected, dtype=torch.uint8, device=self.core.device)  # [nbytes]
        try:
            group = pair.wait_ready(self.chunk_timeout_s)
            work = group.recv([staging], pairing.SENDER_RANK, request.tag)
            work.wait(datetime.timedelta(seconds=self.chunk_timeout_s))
        except Exception as e:  # the sender died or stalled: this pair is done
            pair.is_broken = True
            self.core.fail(request.transfer_id, f"sender lost: {e}")
            return pb.Ack(ok=False, error=f"sender lost: {e}")
        crc = request.crc32 if request.has_checksum else None
        return to_pb(self.core.write_chunk(request.transfer_id, request.layer, request.first_block,
                                           request.num_blocks, staging, crc))

    def Commit(self, request, context):
        self._session(context)
        return to_pb(self.core.commit(request.transfer_id, request.first_token))

    def Abort(self, request, context):
        self._session(context)
        return to_pb(self.core.abort(request.transfer_id, request.reason))


def serve(core: ReceiverCore, transport: str, host: str, port: int, max_workers: int,
          chunk_timeout_s: float = 30.0):
    servicer = KVTransferServicer(core, transport, host, chunk_timeout_s)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="kvt-rx"),
                         options=grpc_options())
    pb_grpc.add_KVTransferServicer_to_server(servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port}")
    server.start()
    core.close_pairs = lambda: servicer.pairs.clear()
    return server, f"{transport}://{host}:{bound}"
