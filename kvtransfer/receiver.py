"""The decode side of a transfer: reserve blocks, accept chunks, report results.

1. ``reserve()`` (owner thread) allocates blocks from the engine's pool and
   returns a Ticket with a lease.
2. Transport threads call ``ReceiverCore.write_chunk/commit/abort`` as
   chunks and control messages arrive; they only ever write into the
   ticket's blocks, under the transfer's lock, while it still accepts data.
3. ``poll()`` (owner thread) expires leases, frees the blocks of FAILED
   transfers and returns every transfer that finished since the last poll.
4. ``release()`` hands a DONE transfer's blocks to the engine.

The BlockPool is touched only from the owner's thread: reserve, renew,
abort, poll, release and close must all be called from one thread (the
decode loop, which polls every step). A lease is enforced twice: transport
threads refuse data once its deadline has passed, and the next poll() frees
the blocks and reports FAILED.
"""
from __future__ import annotations

import secrets as _secrets
import threading
import time
import uuid
import warnings
import zlib
from dataclasses import dataclass

import torch

from engine.block_pool import BlockPool, NoFreeBlocksError  # noqa: F401  (re-exported)
from kvtransfer import auth, slabs
from kvtransfer.ledger import Inbound, Ledger
from kvtransfer.planner import Coverage, blocks_for_tokens
from kvtransfer.types import HandshakeError, Ticket, TransferResult

TRANSPORTS = ("grpc", "nccl", "local")


@dataclass
class Session:
    """One authenticated sender."""

    session_id: str
    transport: str
    pair: object | None = None  # nccl: the pair's process group (pairing.PairGroup)


@dataclass(frozen=True)
class Ack:
    ok: bool
    dropped: bool = False
    error: str = ""


def byte_views(kv_caches: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each layer as ``[num_blocks, slab_bytes]`` uint8, sharing storage."""
    return [kv.view(kv.shape[0], -1).view(torch.uint8) for kv in kv_caches]


class ReceiverCore:
    """The thread-safe half of the receiver: everything a transport thread may call."""

    def __init__(self, kv_caches: list[torch.Tensor], fingerprint: dict[str, str], secret: bytes | str,
                 progress_timeout_s: float = 10.0):
        self.kv_bytes = byte_views(kv_caches)
        self.slab_bytes = self.kv_bytes[0].shape[1]
        self.device = kv_caches[0].device
        self.fingerprint = dict(fingerprint)
        self.secret = auth.as_secret(secret)
        self.progress_timeout_s = progress_timeout_s
        self.ledger = Ledger()
        self._lock = threading.Lock()
        self._nonces: dict[bytes, float] = {}
        self.sessions: dict[str, Session] = {}
        self.on_handshake = None  # set by the nccl service: Session -> pairing info
        self.num_dropped_chunks = 0

    # ---- handshake -----------------------------------------------------
    def hello(self) -> bytes:
        nonce = auth.new_nonce()
        with self._lock:
            now = time.time()
            self._nonces = {n: t for n, t in self._nonces.items() if t > now}
            self._nonces[nonce] = now + 30.0
        return nonce

    def handshake(self, nonce: bytes, proof: bytes, sender_nonce: bytes, fingerprint: dict[str, str],
                  transport: str) -> tuple[Session, bytes]:
        with self._lock:
            expiry = self._nonces.pop(nonce, None)
        if expiry is None or expiry < time.time():
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


class KVReceiver:
    """Decode-side endpoint of the transfer service. See the module docstring for threading.

    max_workers: the service's handler threads (made as needed). A sending grpc link holds one per
    open Push stream (its ``num_channels`` while it sends, none after ``stream_idle_s`` idle), and
    every control call or nccl announce in flight holds one; calls beyond that wait for a thread.
    """

    def __init__(self, kv_caches: list[torch.Tensor], pool: BlockPool, fingerprint: dict[str, str],
                 secret: bytes | str, transport: str = "grpc", host: str = "127.0.0.1", port: int = 0,
                 progress_timeout_s: float = 10.0, max_workers: int = 256, **options):
        if transport not in TRANSPORTS:
            raise ValueError(f"transport: must be one of {TRANSPORTS}, got {transport!r}")
        if not kv_caches:
            raise ValueError("kv_caches: need at least one layer")
        self.pool = pool
        self.transport = transport
        self.block_size = int(kv_caches[0].shape[2])
        self.num_layers = len(kv_caches)
        self.core = ReceiverCore(kv_caches, fingerprint, secret, progress_timeout_s)
        self._server = None
        if transport == "local":
            from kvtransfer.transports import local

            self.endpoint = local.register(self.core)
        else:
            from kvtransfer.transports import service

            self._server, self.endpoint = service.serve(self.core, transport, host, port, max_workers, **options)

    # ---- owner thread ----------------------------------------------------
    def reserve(self, request_id: str, num_tokens: int, lease_s: float = 30.0) -> Ticket:
        """Allocate the blocks for ``num_tokens`` and return their ticket. Raises NoFreeBlocksError."""
        if self.core.ledger.for_request(request_id) is not None:
            raise ValueError(f"request {request_id!r} already has a transfer")
        num_blocks = blocks_for_tokens(num_tokens, self.block_size)
        block_ids = self.pool.allocate(num_blocks)
        ticket = Ticket(uuid.uuid4().hex, request_id, self.endpoint, block_ids, time.time() + lease_s,
                        self.transport)
        self.core.ledger.add(Inbound(ticket, num_tokens, Coverage(self.num_layers, num_blocks),
                                     ticket.lease_deadline))
        return ticket

    def renew(self, request_id: str, lease_s: float) -> None:
        inbound = self.core.ledger.for_request(request_id)
        if inbound is None:
            raise KeyError(f"no transfer for request {request_id!r}")
        self.core.renew(inbound.ticket.transfer_id, lease_s)

    def abort(self, request_id: str) -> None:
        """Fail the transfer and free its blocks now; poll() reports it FAILED. No-op when unknown."""
        inbound = self.core.ledger.for_request(request_id)
        if inbound is None:
            return
        with inbound.lock:
            inbound.fail("aborted by receiver")
            self._free_if_failed(inbound)

    def poll(self) -> list[TransferResult]:
        """Never blocks (beyond a chunk copy in progress): expires leases, frees FAILED blocks."""
        results = []
        now = time.time()
        for inbound in self.core.ledger.all():
            with inbound.lock:
                inbound.accepts(now)  # expires an overdue lease
                if not inbound.state.is_finished or inbound.is_reported:
                    continue
                self._free_if_failed(inbound)
                inbound.is_reported = True
                results.append(inbound.result())
            if inbound.is_freed:
                self.core.ledger.remove(inbound)
        return results

    def release(self, request_id: str) -> list[int]:
        """Hand a DONE transfer's blocks to the engine (which frees them when the sequence ends)."""
        inbound = self.core.ledger.for_request(request_id)
        if inbound is None or inbound.state.name != "DONE":
            raise KeyError(f"no DONE transfer for request {request_id!r}")
        with inbound.lock:
            inbound.is_freed = True
        self.core.ledger.remove(inbound)
        return list(inbound.ticket.block_ids)

    def close(self) -> None:
        """Stop serving; fail every open transfer and free its blocks. DONE, unreleased blocks are freed too."""
        if self._server is not None:
            self._server.stop(grace=None)
            self._server = None
        if self.transport == "local":
            from kvtransfer.transports import local

            local.unregister(self.endpoint)
        for inbound in self.core.ledger.all():
            with inbound.lock:
                inbound.fail("receiver closed")
                if not inbound.is_freed:
                    self.pool.free(inbound.ticket.block_ids)
                    inbound.is_freed = True
            self.core.ledger.remove(inbound)
        self.core.close_sessions()

    def _free_if_failed(self, inbound: Inbound) -> None:  # inbound.lock held
        if inbound.state.name == "FAILED" and not inbound.is_freed:
            self.pool.free(inbound.ticket.block_ids)
            inbound.is_freed = True


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
