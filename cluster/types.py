"""The request and response types that cross the cluster's seams.

One `GenerateRequest` flows from a frontend through the router to the stage
replicas; a backend answers with a stream of `GenerateDelta`, the one delta
type, which the replicas produce (it and the records it carries are defined
in `engine.serving.types` and re-exported here). These are plain
dataclasses: protobuf and JSON stop at the frontends.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from engine.guided import GuidedSpec
from engine.serving.types import (FinishReason, GenerateDelta, RequestTimeline, StageMetrics, StageTimings,
                                  TokenLogprob)

__all__ = ["Stage", "FinishReason", "SamplingParams", "GenerateRequest", "TokenLogprob", "StageMetrics",
           "StageTimings", "RequestTimeline", "ProfileTrace", "GenerateDelta", "ReplicaStatus", "ClusterStatus",
           "OverloadedError", "NoReplicaError", "InvalidRequestError"]


class Stage(str, enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"  # one replica runs both phases


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request. The frontend validates these (`cluster.validation`).

    ``top_k`` of -1 and ``min_p`` of 0 disable those filters (the engine's
    convention; the frontends read a client's top_k of 0 as -1); a
    ``temperature`` of 0 means greedy. ``logprobs`` is the number of top
    alternatives to return per generated token (None: no logprobs at all;
    0: only the sampled token's logprob). The penalties and ``logit_bias``
    are `engine.sampling.SamplingParams`' (0, 0, 1 and none: off);
    ``logit_bias`` is (token id, bias) pairs.
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
    prompt_logprobs: int | None = None  # the prompt's logprobs, with this many alternatives (None: not asked)
    guided: GuidedSpec | None = None  # the output must match it (engine.guided); checked by the frontend
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    # vLLM's extras (engine.sampling.SamplingParams has their meaning)
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()  # vLLM's bad_words, as the frontend tokenized them


@dataclass
class GenerateRequest:
    """A validated, tokenized request; what a `Backend` receives."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    arrival_time: float = field(default_factory=time.monotonic)
    timeline: bool = False  # return a RequestTimeline on the last delta
    arrival_wall_time: float = field(default_factory=time.time)  # the timeline's zero
    # a sibling choice (n > 1) with the same prompt: placed beside it, this request shares its prompt's blocks
    fork_of: str | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True)
class ProfileTrace:
    """A Chrome trace one replica (one rank of it: a tensor-parallel replica writes one per rank,
    `<replica>-rank<r>-...`) wrote for a profile window, on its own host."""

    replica_id: str
    host: str
    path: str


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
    state: str = "serving"  # serving | stalled | restarting | failed (cluster.replicas.ReplicaState)
    num_restarts: int = 0  # times the replica was replaced
    last_error: str = ""  # why it last left the router
    tensor_parallel_size: int = 1  # ranks of the replica (a tensor-parallel replica is one unit)
    rank_pids: tuple[int, ...] = ()  # each rank's process id on the replica's host, rank 0 first
    expert_load: tuple[int, ...] = ()  # a mixture of experts: tokens routed to each expert since start
    num_prompt_tokens_computed: int = 0  # prompt positions the replica ran through the model since start
    num_kv_bytes_sent: int = 0  # prefill: KV bytes of its transfers that ended DONE, since start
    quantization: str = ""  # its weights' format: none, gguf, int8 ("" unknown: no report yet, an older server)
    kernel_isa: str = ""  # its kernel ISA path: avx512bf16, avx512, avx2, or none (torch's ops)
    pipeline_parallel_size: int = 1  # pipeline stages of the replica (ranks = tensor_parallel_size x this)

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
