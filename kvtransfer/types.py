"""The small types that cross the transfer service's boundary (no torch, no gRPC)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field


class TransferError(RuntimeError):
    """A transfer could not proceed; the message says why."""


class HandshakeError(TransferError):
    """The peer was refused: wrong secret, or a model fingerprint mismatch (field named)."""


class PlanError(HandshakeError):
    """The two replicas' KV layouts (or a plan between them) do not write every (layer, KV head) of every
    decode rank exactly once; the message names the missing or doubled piece. Raised before any byte moves."""


class State(enum.IntEnum):
    """A transfer's life cycle; ``state >= State.DONE`` means finished."""

    RESERVED = 0      # receiver: blocks held, no data yet; sender: started, nothing sent
    TRANSFERRING = 1  # chunks are moving
    DONE = 2          # every layer landed and the first token was committed
    FAILED = 3        # aborted, expired, peer lost or refused; blocks freed on the receiver

    @property
    def is_finished(self) -> bool:
        return self >= State.DONE


@dataclass(frozen=True)
class Ack:
    """A receiver's answer to one chunk or control call. ``dropped``: the transfer is unknown, finished,
    aborted or expired, and the chunk touched no block."""

    ok: bool
    dropped: bool = False
    error: str = ""


@dataclass
class Ticket:
    """What the decode side hands the prefill side: where to put one request's KV.

    A plain picklable dataclass: the request channels carry it from the decode
    replica to the frontend and on to the prefill replica; it never crosses
    the transfer service's wire.
    """

    transfer_id: str
    request_id: str
    endpoint: str
    block_ids: list[int]
    lease_deadline: float  # unix time
    transport: str


@dataclass
class TransferResult:
    """How one transfer ended. Each reserve()/start() yields exactly one, from poll().

    On the receiver, FAILED means its blocks are already freed; DONE means they
    wait for release(). ``block_ids`` are the ticket's (receiver) or the source
    blocks (sender), for bookkeeping only. ``finished_at`` is the unix time the
    transfer became DONE or FAILED on this side (poll() reports it later).
    """

    request_id: str
    status: str  # "DONE" | "FAILED"
    first_token: int | None = None
    error: str | None = None
    block_ids: list[int] = field(default_factory=list)
    finished_at: float | None = None
