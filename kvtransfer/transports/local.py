"""The `local` transport: sender and receiver in one process (colocated mode, tests).

Same handshake and same ``ReceiverCore`` calls as the network transports,
without sockets: a chunk is copied straight from the source slabs into the
ticket's blocks, on the sender's thread.
"""
from __future__ import annotations

import threading
import uuid
import weakref
from dataclasses import replace

import torch

from kvtransfer import auth
from kvtransfer.config import SenderConfig
from kvtransfer.planner import ChunkPlan
from kvtransfer.receiver_core import ReceiverCore
from kvtransfer.transports.base import Link, chunk_ids, crc32_of, done, gather
from kvtransfer.types import Ack, HandshakeError, TransferError

_lock = threading.Lock()
_receivers: dict[str, weakref.ref] = {}


def register(core: ReceiverCore) -> str:
    endpoint = f"local://{uuid.uuid4().hex}"
    with _lock:
        _receivers[endpoint] = weakref.ref(core)
    return endpoint


def unregister(endpoint: str) -> None:
    with _lock:
        _receivers.pop(endpoint, None)


class LocalLink(Link):
    def __init__(self, endpoint: str, core: ReceiverCore):
        self.endpoint = endpoint
        self._core_ref = weakref.ref(core)

    @classmethod
    def connect(cls, endpoint: str, fingerprint: dict[str, str], config: SenderConfig) -> "LocalLink":
        secret = auth.as_secret(config.secret)
        core = _lookup(endpoint)
        sender_nonce = auth.new_nonce()
        nonce = core.hello()
        _, proof = core.handshake(nonce, auth.sender_proof(secret, nonce, sender_nonce), sender_nonce,
                                  fingerprint, "local")
        if not auth.proofs_match(proof, auth.receiver_proof(secret, sender_nonce)):
            raise HandshakeError("handshake refused: the receiver does not know the cluster secret")
        link = cls(endpoint, core)
        link.peer_fingerprint = dict(core.fingerprint)
        return link

    def _core(self) -> ReceiverCore | None:
        core = self._core_ref()
        if core is None or _receivers.get(self.endpoint) is None:
            self.is_broken = True
        return core if not self.is_broken else None

    def send_chunk(self, transfer_id, chunk: ChunkPlan, src: torch.Tensor, src_block_ids, checksum):
        core = self._core()
        if core is None:
            return done(Ack(False, error="receiver closed"))
        ack = Ack(True)
        for layer in chunk.layers:  # one copy per layer, source slabs to blocks (a head range: one strided copy)
            part = replace(chunk, layer=layer, num_layers=1)
            data = gather(src, part, chunk_ids(part, src_block_ids))
            crc = crc32_of(data) if checksum else None
            ack = core.write_chunk(transfer_id, layer, chunk.first_block, chunk.num_blocks, data, crc, 1,
                                   chunk.head_start, chunk.num_heads)
            if not ack.ok:
                break
        return done(ack)

    def commit(self, transfer_id, first_token):
        core = self._core()
        return done(core.commit(transfer_id, first_token) if core else Ack(False, error="receiver closed"))

    def abort(self, transfer_id, reason):
        core = self._core()
        return done(core.abort(transfer_id, reason) if core else Ack(False, error="receiver closed"))

    def renew(self, transfer_id, lease_s):
        core = self._core()
        return done(core.renew(transfer_id, lease_s) if core else Ack(False, error="receiver closed"))


def _lookup(endpoint: str) -> ReceiverCore:
    with _lock:
        ref = _receivers.get(endpoint)
    core = ref() if ref is not None else None
    if core is None:
        raise TransferError(f"no local receiver at {endpoint}")
    return core
