"""The request and response types that cross the cluster's seams.

One `GenerateRequest` flows from a frontend through the router to the stage
replicas; a backend answers with a stream of `GenerateDelta`. These are plain
dataclasses: protobuf and JSON stop at the frontends.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field


class Stage(str, enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"  # one replica runs both phases


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop string or a stop token
    LENGTH = "length"  # max_tokens or the context length reached
    ABORT = "abort"  # aborted by the client or the operator
    ERROR = "error"  # failed inside the cluster; the delta's `error` says why


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request. The frontend validates these (`cluster.validation`).

    ``top_k`` of 0 or -1 and ``min_p`` of 0 disable those filters; a
    ``temperature`` of 0 means greedy. ``logprobs`` is the number of top
    alternatives to return per generated token (None: no logprobs at all;
    0: only the sampled token's logprob).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None


@dataclass
class GenerateRequest:
    """A validated, tokenized request; what a `Backend` receives."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    arrival_time: float = field(default_factory=time.monotonic)
    timeline: bool = False  # return a RequestTimeline on the last delta
    arrival_wall_time: float = field(default_factory=time.time)  # the timeline's zero

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), best first


@dataclass(frozen=True)
class StageMetrics:
    """Stage-side timings of one request, carried on its last `GenerateDelta`.

    The backend fills what it measured and leaves the rest None (a colocated
    replica has no transfer; a backend that measures nothing sends no
    `StageMetrics` at all). `cluster.metrics` turns them into histograms and
    counters.

    - ``queue_time_s``: arrival at the router until a replica started the
      prompt (admission queue plus the replica's waiting queue).
    - ``prefill_time_s``: first prompt chunk scheduled until the first token.
    - ``kv_transfer_time_s``: end of the prompt's forward pass until the
      transfer was DONE (what the transfer added after compute; with the
      layer-wise overlap most of it is hidden inside the pass).
    - ``kv_transfer_bytes``: KV bytes moved for the request (retries included).
    - ``num_kv_transfer_failures``: transfers that ended FAILED, retried or not.
    """

    queue_time_s: float | None = None
    prefill_time_s: float | None = None
    kv_transfer_time_s: float | None = None
    kv_transfer_bytes: int = 0
    num_kv_transfer_failures: int = 0


@dataclass(frozen=True)
class RequestTimeline:
    """When a request passed each phase, in seconds after it arrived at the
    frontend; None where the phase did not happen here or was not measured.

    The stamps are ``time.time()`` taken in each process (frontend, prefill
    and decode replicas), so they compare across processes on one host;
    across hosts they are off by the difference of the hosts' clocks.
    """

    routed_s: float | None = None  # the router placed it
    prefill_queued_s: float | None = None  # it entered the prefill (or colocated) replica's queue
    prefill_start_s: float | None = None  # its first prompt chunk was scheduled
    prefill_end_s: float | None = None  # prompt computed, first token sampled
    kv_transfer_done_s: float | None = None  # the decode replica had every layer (disaggregated)
    first_decode_step_s: float | None = None  # the first decode step after the first token
    finish_s: float | None = None  # the last delta reached the backend

    PHASES = ("routed_s", "prefill_queued_s", "prefill_start_s", "prefill_end_s", "kv_transfer_done_s",
              "first_decode_step_s", "finish_s")

    def phases(self) -> dict[str, float]:
        """The phases that are set, in order."""
        return {k: getattr(self, k) for k in self.PHASES if getattr(self, k) is not None}


@dataclass(frozen=True)
class ProfileTrace:
    """A Chrome trace one replica wrote for a profile window, on its own host."""

    replica_id: str
    host: str
    path: str


@dataclass
class GenerateDelta:
    """What one request produced since its previous delta.

    ``text`` is the detokenized text of ``token_ids`` (the backend detokenizes
    incrementally and applies stop strings, so ``text`` may hold back a few
    characters until they are known not to start a stop string). The last
    delta of a stream, and only it, has ``finish_reason`` set.
    """

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token in token_ids
    num_cached_tokens: int = 0  # prompt tokens served from a prefix cache (final delta)
    error: str | None = None  # set with FinishReason.ERROR
    stage_metrics: StageMetrics | None = None  # optional, on the last delta only
    timeline: RequestTimeline | None = None  # on the last delta, when the request asked for it


@dataclass(frozen=True)
class ReplicaStatus:
    replica_id: str
    stage: Stage
    is_alive: bool = True
    num_running_seqs: int = 0
    num_queued_prefill_tokens: int = 0
    num_in_flight: int = 0  # requests the router placed here and not yet released
    num_free_blocks: int = 0
    num_total_blocks: int = 0

    @property
    def kv_usage(self) -> float:
        """Fraction of the KV cache in use, 0..1."""
        if self.num_total_blocks <= 0:
            return 0.0
        return 1.0 - self.num_free_blocks / self.num_total_blocks


@dataclass(frozen=True)
class ClusterStatus:
    model_name: str
    mode: str  # "disaggregated" | "colocated"
    replicas: tuple[ReplicaStatus, ...] = ()
    num_waiting: int = 0  # requests in the router's admission queue


class OverloadedError(RuntimeError):
    """Every replica is at capacity and the admission queue is full or timed out.

    Frontends map it to RESOURCE_EXHAUSTED (HTTP 429).
    """


class NoReplicaError(RuntimeError):
    """No live replica can serve a stage the request needs (UNAVAILABLE / 503)."""


class InvalidRequestError(ValueError):
    """A request field is invalid. ``str(err)`` is ``"<field>: <problem>"``."""

    def __init__(self, field_name: str, problem: str):
        super().__init__(f"{field_name}: {problem}")
        self.field = field_name
        self.problem = problem
