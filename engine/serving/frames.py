"""The request channel's vocabulary: one small dataclass per frame.

Frontend -> replica (commands), each for one request:

    Submit(rid, prompt, params)    colocated replica: the whole request (fork_of: a sibling choice's rid)
    Prefill(rid, prompt, params)   prefill replica: compute the prompt
    Reserve(rid, prompt, params)   decode replica: blocks for its KV, answered by a TicketReady
    Attach(rid, ticket)            prefill replica: where to push the prompt's KV
    Abort(rid)                     end it and free what it holds
    PrefillLost(rid, replica)      decode replica: the prefill replica that was sending the KV is gone

Replica -> frontend (events):

    TicketReady(rid, ticket)       decode: the reservation's ticket
    FirstToken(delta)              prefill: the first token, as soon as it is sampled
    Deltas([delta, ...])           decode/colocated: one frame for all of one step's outputs
    PrefillDone(rid, error, timings)   prefill: the transfer ended (error None: DONE)
    Refused(rid, error)            a command the replica could not take; it holds nothing for it

and, from the frontend's channel server to a request it is running,
``Lost(replica_id)`` when one of its replicas' channels breaks.

A request that resumes elsewhere (its replica died mid-stream) carries the
output tokens its client already has: the replica computes them with the
prompt and goes on after them, with max_tokens, stop strings and seeded
draws (a function of the position) exactly as if it had produced them.

A request's tokens take one path: the first from the prefill replica (in
`FirstToken`), every later one from the decode replica (in `Deltas`); the
decode replica admits the prefilled sequence with its first token already
emitted (`EngineCore.admit_prefilled`). Plain dataclasses, no torch; the
ticket is the transfer service's and opaque here.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.sampling import SamplingParams
from engine.serving.types import GenerateDelta, StageTimings


# ---- commands (frontend -> replica) -------------------------------------------
@dataclass(frozen=True)
class _Start:
    """A request's first command to a replica."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)  # a resumed request's tokens so far
    # a sibling choice's request id on this replica: share its prompt's full blocks (n > 1, `Sequence.fork_of`)
    fork_of: str | None = None


class Submit(_Start):
    """Colocated replica: the whole request."""


class Prefill(_Start):
    """Prefill replica: compute the prompt (and any resumed output), sample the next token."""


class Reserve(_Start):
    """Decode replica: blocks for the KV of every token so far, answered by a TicketReady."""


@dataclass(frozen=True)
class Attach:
    request_id: str
    ticket: object  # kvtransfer.Ticket


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class PrefillLost:
    """Decode replica: the prefill replica computing this request's KV went after its first token and
    before the transfer ended, so no more of the KV will come: unless every layer has landed, the transfer
    fails now (and the request with it, which the frontend migrates) instead of at the end of its lease."""

    request_id: str
    replica_id: str


Command = Submit | Prefill | Reserve | Attach | Abort | PrefillLost


# ---- events (replica -> frontend) ---------------------------------------------
@dataclass(frozen=True)
class TicketReady:
    request_id: str
    ticket: object  # kvtransfer.Ticket


@dataclass(frozen=True)
class FirstToken:
    delta: GenerateDelta  # one token, its text (a possible stop-string start held back) and logprobs

    @property
    def request_id(self) -> str:
        return self.delta.request_id


@dataclass(frozen=True)
class Deltas:
    deltas: list[GenerateDelta]


@dataclass(frozen=True)
class PrefillDone:
    request_id: str
    error: str | None  # None: the KV landed (DONE)
    timings: StageTimings

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True)
class Refused:
    request_id: str
    error: str


@dataclass(frozen=True)
class Lost:
    """Not on the wire: the channel server's word to a request that a replica's channel broke."""

    replica_id: str


Event = TicketReady | FirstToken | Deltas | PrefillDone | Refused
