"""The thread-safe half of the receiver: what a transport thread may call.

``KVReceiver`` (receiver.py) owns one ``ReceiverCore`` and the BlockPool; the
transports (transports/service.py, transports/local.py) get only the core:
the handshake, and ``write_chunk/commit/abort/renew``, which write only into
a ticket's blocks, under the transfer's lock, while it still accepts data.

It holds every decode rank's cache (rank -> layer; one rank at TP=1) and
the replica's KVLayout. The handshake accepts a sender of another
tensor-parallel layout when every other fingerprint field agrees and the
reshard plan from its layout covers every (layer, head) of every rank here
exactly once (reshard.check_plan); a pipeline-parallel sender's ranks must
hold every layer exactly once, a gap or an overlap refused naming the layers.
This replica itself is one pipeline stage (KVLayout.check_decode). A chunk names a global KV-head range; it
is written into each rank that holds some of those heads (replicated heads:
into each of them), at that rank's local offsets.
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
from kvtransfer.layout import LAYOUT_FIELDS, KVLayout, normalize_caches, with_layout
from kvtransfer.ledger import Ledger
from kvtransfer.reshard import TransferPlan
from kvtransfer.types import Ack, HandshakeError, PlanError

NONCE_TTL_S = 30.0  # a Hello's nonce must be answered by a Handshake within this
MAX_NONCES_PER_PEER = 64  # a peer's pending nonces past this push out its oldest
MAX_NONCES = 4096  # pending nonces of all peers; past this, Hello is refused until some expire or are used


@dataclass
class Session:
    """One authenticated sender."""

    session_id: str
    transport: str
    plan: TransferPlan | None = None  # from the sender's layout into this replica's, checked
    pair: object | None = None  # nccl: the pair's process group (pairing.PairGroup)


class ReceiverCore:
    """The thread-safe half of the receiver: everything a transport thread may call."""

    def __init__(self, kv_caches, fingerprint: dict[str, str], secret: bytes | str,
                 progress_timeout_s: float = 10.0, layout: KVLayout | None = None):
        """kv_caches: rank -> layer -> tensor, or at TP=1 layer -> tensor; layout: None at TP=1 (read from the
        cache's shape)."""
        rank_caches = normalize_caches(kv_caches)
        if layout is None:
            if len(rank_caches) > 1:
                raise ValueError(f"kv_caches: {len(rank_caches)} ranks need their KVLayout")
            layout = KVLayout.of_caches(rank_caches[0])
        layout.check_decode()
        layout.check_caches(rank_caches)
        self.layout = layout
        self.kv_bytes = [slabs.byte_views(layers) for layers in rank_caches]  # rank -> layer -> [blocks, slab]
        self.kv_heads = slabs.rank_views(rank_caches)  # rank -> layer -> [blocks, rows, heads, head_bytes]
        self.head_bytes = layout.head_bytes
        self.slab_bytes = layout.num_kv_heads * layout.head_bytes  # a block of a layer, every head
        self.device = rank_caches[0][0].device
        self.fingerprint = with_layout(fingerprint, layout)
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
        mismatch = auth.fingerprint_mismatch(self.fingerprint, dict(fingerprint), ignore=LAYOUT_FIELDS)
        if mismatch:
            raise HandshakeError(f"handshake refused: {mismatch}")
        try:  # a sender of any PP x TP layout, as long as its plan covers every layer and rank here once
            theirs = KVLayout.from_fingerprint(dict(fingerprint))
            plan = theirs.plan_to(self.layout)
        except PlanError as e:
            raise PlanError(f"handshake refused: KV layout of {theirs.shape_name} into {self.layout.shape_name}: "
                            f"{e}") from None
        except ValueError as e:
            raise HandshakeError(f"handshake refused: {e}") from None
        session = Session(_secrets.token_hex(16), transport, plan)
        with self._lock:
            self.sessions[session.session_id] = session
        return session, auth.receiver_proof(self.secret, sender_nonce)

    def session(self, session_id: str) -> Session | None:
        with self._lock:
            return self.sessions.get(session_id)

    # ---- data path (any thread) -----------------------------------------
    def chunk_nbytes(self, num_layers: int, num_blocks: int, num_heads: int = 0) -> int:
        """A chunk's size: its layers x blocks x KV heads (0: every head)."""
        return max(1, num_layers) * num_blocks * (num_heads or self.layout.num_kv_heads) * self.head_bytes

    def write_chunk(self, transfer_id: str, layer: int, first_block: int, num_blocks: int,
                    data: torch.Tensor | bytes | memoryview, crc32: int | None = None, num_layers: int = 1,
                    head_start: int = 0, num_heads: int = 0) -> Ack:
        """Copy global KV heads ``[head_start, +num_heads)`` (0: all) of the ticket's blocks ``[first_block,
        +num_blocks)`` of layers ``[layer, +num_layers)`` into every rank here that holds them.

        data: ``num_layers * num_blocks`` pieces, layer-major, in ticket order, each a block's
        ``[2 * block_size, num_heads, head_dim]`` (a TP=1 sender's whole slabs).
        """
        inbound = self.ledger.get(transfer_id)
        if inbound is None:
            return self._drop()
        num_layers = max(1, num_layers)
        num_heads = num_heads or self.layout.num_kv_heads - head_start
        nbytes = self.chunk_nbytes(num_layers, num_blocks, num_heads)
        if crc32 is not None and _crc32(data) != crc32:
            with inbound.lock:
                inbound.fail(f"checksum mismatch on layer {layer}, blocks from {first_block}")
            return Ack(False, error=f"checksum mismatch on layer {layer}")
        with inbound.lock:
            if not inbound.accepts(time.time()):
                return self._drop()
            cov = inbound.coverage
            bad = (cov.check_range(layer, first_block, num_blocks, head_start, num_heads)
                   or cov.check_range(layer + num_layers - 1, first_block, num_blocks, head_start, num_heads)
                   or (None if _nbytes(data) == nbytes else f"chunk has {_nbytes(data)} bytes, expected {nbytes}"))
            if bad:
                inbound.fail(f"bad chunk: {bad}")
                return Ack(False, error=bad)
            src = _as_uint8(data).view(num_layers, num_blocks, 2 * self.layout.block_size, num_heads, -1)
            block_ids = inbound.ticket.block_ids[first_block:first_block + num_blocks]
            heads = range(head_start, head_start + num_heads)
            for i in range(num_layers):
                self._scatter(layer + i, block_ids, heads, src[i])  # [blocks, rows, heads, head_bytes]
                inbound.record_chunk(layer + i, first_block, num_blocks, time.time(), self.progress_timeout_s,
                                     head_start, num_heads)
        return Ack(True)

    def _scatter(self, layer: int, block_ids: list[int], heads: range, src: torch.Tensor) -> None:
        """The chunk's heads into each rank that holds some: whole slabs where the chunk is exactly that rank's
        heads, else a strided copy of the overlap."""
        for rank, held in enumerate(self.layout.rank_heads):
            lo, hi = max(heads.start, held.start), min(heads.stop, held.stop)
            if lo >= hi:
                continue
            if (lo, hi) == (held.start, held.stop) == (heads.start, heads.stop):
                slabs.scatter(self.kv_bytes[rank][layer], block_ids, src.reshape(len(block_ids), -1))
            else:
                slabs.scatter_heads(self.kv_heads[rank][layer], block_ids, lo - held.start,
                                    src[:, :, lo - heads.start:hi - heads.start])

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
