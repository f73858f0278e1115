"""The receiver's per-transfer state machine. Plain Python: no torch, no gRPC.

    reserve ──> RESERVED ──chunk──> TRANSFERRING ──commit + every layer──> DONE ──release──> engine
                    │                    │
                    └── abort / lease expired / peer lost / bad chunk ──> FAILED (blocks freed)

Rules that keep late writes out of reused blocks:

- a transport thread writes a chunk only while holding ``Inbound.lock`` and
  only after ``accepts()`` said yes under that same lock;
- blocks are freed only on the owner's thread (``KVReceiver.poll/abort``),
  after the state became FAILED under the lock. So once freed, every later
  ``accepts()`` says no, and no write is in progress.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from kvtransfer.planner import Coverage
from kvtransfer.types import State, Ticket, TransferResult


@dataclass(eq=False)
class Inbound:
    ticket: Ticket
    num_tokens: int
    coverage: Coverage
    deadline: float  # lease; each accepted chunk extends it by progress_timeout_s
    state: State = State.RESERVED
    first_token: int | None = None
    error: str | None = None
    is_reported: bool = False
    is_freed: bool = False  # blocks returned to the pool (FAILED) or handed to the engine (DONE)
    finished_at: float | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    # All methods below expect self.lock held.
    def accepts(self, now: float) -> bool:
        if self.state.is_finished:
            return False
        if now > self.deadline:
            self.fail("lease expired")
            return False
        return True

    def fail(self, error: str) -> None:
        if not self.state.is_finished:
            self.error = error
            self._finish(State.FAILED)

    def _finish(self, state: State) -> None:
        self.state, self.finished_at = state, time.time()

    def record_chunk(self, layer: int, first_block: int, num_blocks: int, now: float, progress_timeout_s: float,
                     head_start: int = 0, num_heads: int | None = None) -> None:
        self.coverage.add(layer, first_block, num_blocks, head_start, num_heads)
        self.state = State.TRANSFERRING
        self.deadline = max(self.deadline, now + progress_timeout_s)
        if self.first_token is not None and self.coverage.is_complete:
            self._finish(State.DONE)

    def commit(self, first_token: int) -> None:
        """DONE now if every layer landed, else as soon as the last chunk does.

        The sender commits right after *sending* the last chunk, so the commit
        may overtake it; a sender that never completes the layers runs into
        the lease (extended by each chunk) and the transfer FAILS.
        """
        self.first_token = first_token
        if self.coverage.is_complete:
            self._finish(State.DONE)

    def result(self) -> TransferResult:
        first_token = self.first_token if self.state == State.DONE else None
        return TransferResult(self.ticket.request_id, self.state.name, first_token, self.error,
                              list(self.ticket.block_ids), self.finished_at)


class Ledger:
    """Inbound transfers by transfer id and by request id; the registry lock guards only the maps."""

    def __init__(self):
        self._lock = threading.Lock()
        self._by_transfer: dict[str, Inbound] = {}
        self._by_request: dict[str, Inbound] = {}

    def add(self, inbound: Inbound) -> None:
        with self._lock:
            if inbound.ticket.request_id in self._by_request:
                raise ValueError(f"request {inbound.ticket.request_id!r} already has a transfer")
            self._by_transfer[inbound.ticket.transfer_id] = inbound
            self._by_request[inbound.ticket.request_id] = inbound

    def get(self, transfer_id: str) -> Inbound | None:
        with self._lock:
            return self._by_transfer.get(transfer_id)

    def for_request(self, request_id: str) -> Inbound | None:
        with self._lock:
            return self._by_request.get(request_id)

    def remove(self, inbound: Inbound) -> None:
        with self._lock:
            self._by_transfer.pop(inbound.ticket.transfer_id, None)
            if self._by_request.get(inbound.ticket.request_id) is inbound:
                del self._by_request[inbound.ticket.request_id]

    def all(self) -> list[Inbound]:
        with self._lock:
            return list(self._by_transfer.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_transfer)


def now() -> float:
    return time.time()
