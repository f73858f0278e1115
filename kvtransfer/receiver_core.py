"""The thread-safe half of the receiver: what a transport thread may call.

``KVReceiver`` (receiver.py) owns one ``ReceiverCore`` and the BlockPool; the
transports (transports/service.py, transports/local.py) get only the core:
the handshake, and ``write_chunk/commit/abort/renew``, which write only into
a ticket's blocks, under the transfer's lock, while it still accepts data.
This module imports no transport, so a transport may import it.
"""
from __future__ import annotations

import secrets as _secrets
import threading
import time
import warnings
import zlib
from dataclasses import dataclass

import torch

from kvtransfer import auth, slabs
from kvtransfer.ledger import Ledger
from kvtransfer.types import Ack, HandshakeError

NONCE_TTL_S = 30.0  # a Hello's nonce must be answered by a Handshake within this
MAX_NONCES_PER_PEER = 64  # a peer's pending nonces past this push out its oldest
MAX_NONCES = 4096  # pending nonces of all peers; past this, Hello is refused until some expire or are used


@dataclass
class Session:
    """One authenticated sender."""

    session_id: str
    transport: str
    pair: object | None = None  # nccl: the pair's process group (pairing.PairGroup)


class ReceiverCore:
    """The thread-safe half of the receiver: everything a transport thread may call."""

    def __init__(self, kv_caches: list[torch.Tensor], fingerprint: dict[str, str], secret: bytes | str,
                 progress_timeout_s: float = 10.0):
        self.kv_bytes = slabs.byte_views(kv_caches)
        self.slab_bytes = self.kv_bytes[0].shape[1]
        self.device = kv_caches[0].device
        self.fingerprint = dict(fingerprint)
        self.secret = auth.as_secret(secret)
        self.progress_timeout_s = progress_timeout_s
        self.ledger = Ledger()
        self._lock = threading.Lock()
        self._nonces: dict[bytes, tuple[float, str]] = {}  # nonce -> (expiry, peer), oldest first
        self._nonces_by_peer: dict[str, list[bytes]] = {}  # oldest first
        self.sessions: dict[str, Session] = {}
        self.num_dropped_chunks = 0

    # ---- handshake -----------------------------------------------------
    def hello(self, peer: str = "local") -> bytes:
        """A fresh nonce for ``peer`` (its address without the port) to answer in `handshake`.

        Before any proof of the secret, so bounded: at most MAX_NONCES_PER_PEER
        pending per peer (a new one pushes out the peer's oldest) and
        MAX_NONCES in all (past that, HandshakeError until some expire).
        """
        nonce = auth.new_nonce()
        with self._lock:
            now = time.time()
            self._expire_nonces(now)
            mine = self._nonces_by_peer.setdefault(peer, [])
            if len(mine) >= MAX_NONCES_PER_PEER:
                self._nonces.pop(mine.pop(0), None)
            elif len(self._nonces) >= MAX_NONCES:
                if not mine:
                    del self._nonces_by_peer[peer]
                raise HandshakeError(f"handshake refused: {MAX_NONCES} handshakes pending, try again later")
            self._nonces[nonce] = (now + NONCE_TTL_S, peer)
            mine.append(nonce)
        return nonce

    @property
    def num_pending_nonces(self) -> int:
        with self._lock:
            return len(self._nonces)

    def _expire_nonces(self, now: float) -> None:
        """Drop expired nonces (they are in expiry order: every one gets the same TTL). Under the lock."""
        while self._nonces:
            nonce, (expiry, peer) = next(iter(self._nonces.items()))
            if expiry > now:
                return
            self._forget_nonce(nonce)

    def _forget_nonce(self, nonce: bytes) -> tuple[float, str] | None:
        entry = self._nonces.pop(nonce, None)
        if entry is not None:
            mine = self._nonces_by_peer.get(entry[1])
            if mine is not None:
                mine.remove(nonce)
                if not mine:
                    del self._nonces_by_peer[entry[1]]
        return entry

    def handshake(self, nonce: bytes, proof: bytes, sender_nonce: bytes, fingerprint: dict[str, str],
                  transport: str) -> tuple[Session, bytes]:
        with self._lock:
            entry = self._forget_nonce(nonce)
        if entry is None or entry[0] < time.time():
            raise HandshakeError("handshake refused: unknown or stale nonce")
        if not auth.proofs_match(proof, auth.sender_proof(self.secret, nonce, sender_nonce)):
            raise HandshakeError("handshake refused: the sender does not know the cluster secret")
        mismatch = auth.fingerprint_mismatch(self.fingerprint, dict(fingerprint))
        if mismatch:
            raise HandshakeError(f"handshake refused: {mismatch}")
        session = Session(_secrets.token_hex(16), transport)
        with self._lock:
            self.sessions[session.session_id] = session
        return session, auth.receiver_proof(self.secret, sender_nonce)

    def session(self, session_id: str) -> Session | None:
        with self._lock:
            return self.sessions.get(session_id)

    # ---- data path (any thread) -----------------------------------------
    def write_chunk(self, transfer_id: str, layer: int, first_block: int, num_blocks: int,
                    data: torch.Tensor | bytes | memoryview, crc32: int | None = None, num_layers: int = 1) -> Ack:
        """Copy slabs into the ticket's blocks ``[first_block, +num_blocks)`` of layers ``[layer, +num_layers)``.

        data: ``num_layers * num_blocks * slab_bytes`` bytes, layer-major, slabs in ticket order.
        """
        inbound = self.ledger.get(transfer_id)
        if inbound is None:
            return self._drop()
        num_layers = max(1, num_layers)
        nbytes = num_layers * num_blocks * self.slab_bytes
        if crc32 is not None and _crc32(data) != crc32:
            with inbound.lock:
                inbound.fail(f"checksum mismatch on layer {layer}, blocks from {first_block}")
            return Ack(False, error=f"checksum mismatch on layer {layer}")
        with inbound.lock:
            if not inbound.accepts(time.time()):
                return self._drop()
            bad = (inbound.coverage.check_range(layer, first_block, num_blocks)
                   or inbound.coverage.check_range(layer + num_layers - 1, first_block, num_blocks)
                   or (None if _nbytes(data) == nbytes else f"chunk has {_nbytes(data)} bytes, expected {nbytes}"))
            if bad:
                inbound.fail(f"bad chunk: {bad}")
                return Ack(False, error=bad)
            src = _as_uint8(data).view(num_layers, num_blocks, self.slab_bytes)  # [layers, blocks, slab_bytes]
            block_ids = inbound.ticket.block_ids[first_block:first_block + num_blocks]
            for i in range(num_layers):
                slabs.scatter(self.kv_bytes[layer + i], block_ids, src[i])
                inbound.record_chunk(layer + i, first_block, num_blocks, time.time(), self.progress_timeout_s)
        return Ack(True)

    def commit(self, transfer_id: str, first_token: int) -> Ack:
        inbound = self.ledger.get(transfer_id)
        if inbound is None:
            return self._drop()
        with inbound.lock:
            if not inbound.accepts(time.time()):
                return self._drop()
            inbound.commit(first_token)
        return Ack(True)

    def abort(self, transfer_id: str, reason: str) -> Ack:
        inbound = self.ledger.get(transfer_id)
        if inbound is None:
            return self._drop()
        with inbound.lock:
            inbound.fail(f"aborted by sender: {reason}" if reason else "aborted by sender")
        return Ack(True)

    def fail(self, transfer_id: str, error: str) -> None:
        inbound = self.ledger.get(transfer_id)
        if inbound is not None:
            with inbound.lock:
                inbound.fail(error)

    def renew(self, transfer_id: str, lease_s: float) -> Ack:
        inbound = self.ledger.get(transfer_id)
        if inbound is None:
            return self._drop()
        with inbound.lock:
            if not inbound.accepts(time.time()):
                return self._drop()
            inbound.deadline = max(inbound.deadline, time.time() + lease_s)
        return Ack(True)

    def drop_session(self, session_id: str) -> None:
        with self._lock:
            self.sessions.pop(session_id, None)

    def close_sessions(self) -> None:
        with self._lock:
            self.sessions.clear()

    def _drop(self) -> Ack:
        with self._lock:
            self.num_dropped_chunks += 1
        return Ack(False, dropped=True, error="transfer unknown, finished, aborted or expired")


def _nbytes(data) -> int:
    if isinstance(data, torch.Tensor):
        return data.numel() * data.element_size()
    return memoryview(data).nbytes


def _as_uint8(data) -> torch.Tensor:
    if isinstance(data, torch.Tensor):
        return data.reshape(-1).view(torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read-only buffer: we only read from it
        return torch.frombuffer(data, dtype=torch.uint8)


def _crc32(data) -> int:
    if isinstance(data, torch.Tensor):
        data = data.reshape(-1).view(torch.uint8).cpu().numpy()
    return zlib.crc32(data) & 0xFFFFFFFF
