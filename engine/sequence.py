"""The one request object that flows through the scheduler and runner.

Plain Python, no torch: the scheduler and block pool import it.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from engine.sampling import SamplingParams
from engine.serving.types import StageTimings


class SequenceStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    # everything from here on is finished
    FINISHED_STOPPED = 10
    FINISHED_LENGTH = 11
    FINISHED_ABORTED = 12
    FINISHED_ERROR = 13

    @property
    def is_finished(self) -> bool:
        return self >= SequenceStatus.FINISHED_STOPPED


FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
    SequenceStatus.FINISHED_ERROR: "error",
}


@dataclass
class RequestMetrics:
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    kv_ready_time: float | None = None  # decode stage: the prompt's KV (and first token) arrived
    first_decode_time: float | None = None  # the first step after the first token
    finished_time: float | None = None
    num_preemptions: int = 0

    def wall_times(self) -> dict[str, float]:
        """The stamps that are set, as wall-clock times (``time.time()``), to
        compare with stamps from other processes on the same host."""
        offset = time.time() - time.monotonic()
        stamps = {"arrival": self.arrival_time, "first_scheduled": self.first_scheduled_time,
                  "first_token": self.first_token_time, "kv_ready": self.kv_ready_time,
                  "first_decode": self.first_decode_time, "finished": self.finished_time}
        return {k: v + offset for k, v in stamps.items() if v is not None}

    def timings(self) -> StageTimings:
        """The stamps as wall-clock times, for the frontend (`StageTimings`)."""
        w = self.wall_times()
        return StageTimings(queued=w.get("arrival"), first_scheduled=w.get("first_scheduled"),
                            first_token=w.get("first_token"), kv_ready=w.get("kv_ready"),
                            first_decode=w.get("first_decode"), finished=w.get("finished"),
                            num_preemptions=self.num_preemptions)

    def as_dict(self) -> dict:
        """The offline API's metrics (`RequestOutput.metrics`)."""
        d = {"num_preemptions": self.num_preemptions, "wall_times": self.wall_times()}
        if self.first_scheduled_time is not None:
            d["queue_time"] = self.first_scheduled_time - self.arrival_time
        if self.first_token_time is not None:
            d["ttft"] = self.first_token_time - self.arrival_time
        if self.finished_time is not None:
            d["e2e"] = self.finished_time - self.arrival_time
        return d


@dataclass
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    status: SequenceStatus = SequenceStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict] = field(default_factory=list)
    # params.prompt_logprobs set: entry i is prompt token i + 1's, from position i's logits (the sampler's
    # dicts, with the token's rank); positions computed again after a preemption add nothing
    prompt_logprobs: list[dict] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # of full blocks, chained
    num_cached_blocks: int = 0  # leading blocks registered in the prefix cache
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    num_prefix_hit_tokens: int = 0
    error: str | None = None
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    # prefill-only sequences stop after their first token and keep their blocks
    # (the prefill stage frees them once the KV transfer has finished)
    prefill_only: bool = False
    grammar: object | None = None  # engine.guided.GrammarState of a guided sequence, once its grammar compiled
    # choice j > 0 of a request with n > 1: shares the full blocks of this sequence's prompt (the same
    # prompt) once it has computed them, instead of computing them again (`KVCacheManager.admit`)
    fork_of: Sequence | None = field(default=None, repr=False, compare=False)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    @property
    def prompt_logprobs_pending(self) -> bool:
        """Whether the prompt's logprobs are asked for and some are still to be computed."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens - 1

    def token_at(self, i: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]

    def tokens_slice(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n]
