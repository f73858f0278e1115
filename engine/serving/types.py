"""The records that cross the seam between a stage replica and the frontend.

One `GenerateDelta` type carries a request's output from the replica that
produced it, through the request channel and the backend, to the frontends,
which convert it to protobuf or JSON. A replica fills the token fields (and,
on the last delta, its `StageTimings`); the backend adds what only it knows
(the prefill replica's metrics, the request's timeline) to the last one.

Plain dataclasses, no torch: the router and the frontends import them.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop string or a stop token
    LENGTH = "length"  # max_tokens or the context length reached
    ABORT = "abort"  # aborted by the client or the operator
    ERROR = "error"  # failed inside the cluster; the delta's `error` says why


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), best first
    rank: int | None = None  # a prompt token's: 1 + how many tokens the model found likelier; None: not computed

    @classmethod
    def from_sampler(cls, token_id: int, info: dict) -> TokenLogprob:
        """From the sampler's ``{"token_logprob": float, "top": [(id, logprob), ...]}`` (and a prompt
        token's ``"rank"``, `engine.runner.score_rows`)."""
        return cls(token_id, info["token_logprob"], tuple((int(a), float(b)) for a, b in info["top"]),
                   info.get("rank"))


@dataclass(frozen=True)
class StageTimings:
    """When one request passed each point on one replica, as ``time.time()``
    stamps (they compare across processes on one host); None where the point
    was not reached there.

    A prefill replica sets ``queued``, ``first_scheduled``, ``first_token``
    and the transfer's figures; a decode replica ``queued`` (its reservation
    or, colocated, its arrival), ``kv_ready``, ``first_decode`` and
    ``finished``; a colocated replica everything but the transfer.
    """

    queued: float | None = None  # entered this replica
    first_scheduled: float | None = None  # its first prompt chunk was scheduled
    first_token: float | None = None  # prompt computed, first token sampled
    kv_ready: float | None = None  # decode: every layer of the prompt's KV had landed
    first_decode: float | None = None  # the first decode step after the first token
    finished: float | None = None
    num_preemptions: int = 0
    # prefill: end of the prompt's forward pass until the transfer was DONE or FAILED
    kv_transfer_time_s: float | None = None
    kv_transfer_bytes: int = 0

    @property
    def queue_time_s(self) -> float | None:
        if self.queued is None or self.first_scheduled is None:
            return None
        return self.first_scheduled - self.queued

    @property
    def prefill_time_s(self) -> float | None:
        if self.first_scheduled is None or self.first_token is None:
            return None
        return self.first_token - self.first_scheduled


@dataclass(frozen=True)
class StageMetrics:
    """Stage-side timings of one request, carried on its last `GenerateDelta`.

    The backend fills what it measured and leaves the rest None (a colocated
    replica has no transfer; a backend that measures nothing sends no
    `StageMetrics` at all). `cluster.metrics` turns them into histograms and
    counters.

    - ``queue_time_s``: arrival at the replica until it started the prompt.
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


@dataclass
class GenerateDelta:
    """What one request produced since its previous delta.

    ``text`` is the detokenized text of ``token_ids`` (the replica
    detokenizes incrementally and applies stop strings, so ``text`` may hold
    back a few characters until they are known not to start a stop string).
    The last delta of a stream, and only it, has ``finish_reason`` set.
    """

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token in token_ids
    # on the first delta of a request that asked for them: one per prompt token after the first
    prompt_logprobs: list[TokenLogprob] | None = None
    num_cached_tokens: int = 0  # prompt tokens served from a prefix cache (first and last delta)
    error: str | None = None  # set with FinishReason.ERROR
    stop_reason: str | int | None = None  # the stop string or token that ended it (last delta)
    timings: StageTimings | None = None  # the producing replica's, on the last delta
    stage_metrics: StageMetrics | None = None  # set by the backend, on the last delta only
    timeline: RequestTimeline | None = None  # set by the backend when the request asked for it
    migrations: tuple[str, ...] = ()  # set by the backend: why each migration happened (last delta)
    lost_cause: str = ""  # set by the backend: the replica failure that ended the request (last delta)

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class LoadReport:
    """What a replica reports to the router, a snapshot taken by its loop
    thread after each round."""

    replica_id: str
    is_alive: bool = True
    num_queued_prefill_tokens: int = 0  # prompt tokens waiting to be computed
    num_running_seqs: int = 0
    num_waiting_seqs: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    num_sending: int = 0  # prefill: transfers in flight
    num_incoming: int = 0  # decode: reservations waiting for their KV
    error: str = ""  # why the loop died (is_alive False), e.g. a tensor-parallel rank gone
    # a mixture of experts: tokens routed to each expert since start, summed over the sparse
    # layers (EngineCore.expert_load has them per layer); empty for a dense model
    expert_load: tuple[int, ...] = ()
    num_prompt_tokens_computed: int = 0  # prompt positions this replica ran through the model, since start
    num_kv_bytes_sent: int = 0  # prefill: KV bytes of the transfers that ended DONE, since start
    # what the replica runs: its weights' format (EngineConfig.quantization: none, gguf, int8)
    # and its kernel ISA path (avx512bf16, avx512, avx2, or none: torch's ops); "" where unknown
    quantization: str = ""
    kernel_isa: str = ""
    pipeline_parallel_size: int = 1  # its pipeline stages (each of tensor_parallel_size ranks)
