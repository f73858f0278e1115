"""Continuous batching with chunked prefill, prefix caching, forks and preemption.

Each step spends a token budget: running sequences first (one token each when
decoding, the next chunk when a long prompt is still being prefilled), then
waiting sequences in arrival order. When the pool cannot hold a running
sequence's next token, the most recently admitted sequence is preempted: its
blocks are freed and it is recomputed later from its tokens (the prefix cache
usually makes that cheap). Nothing is dropped. The choices of a request
with n > 1 are sequences of one prompt: each after the first waits (others
may pass it) until the first has computed the prompt, then forks its full
blocks (`KVCacheManager.admit`).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from engine.kv_manager import KVCacheManager
from engine.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int
    start: int  # first position computed this step

    @property
    def samples(self) -> bool:
        """The chunk reaches the sequence's last token, so a token is sampled."""
        return self.start + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager):
        self.config = config
        self.kv = kv
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """Admit a sequence whose prompt KV already sits in its blocks (decode stage)."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def num_queued_prefill_tokens(self) -> int:
        return sum(s.num_tokens - s.num_computed_tokens for s in self.waiting) + sum(
            s.num_tokens - s.num_computed_tokens - 1 for s in self.running
            if s.num_tokens - s.num_computed_tokens > 1)

    def schedule(self, busy: set[str] | None = None, max_seqs: int | None = None) -> SchedulerOutput:
        """The next batch. With pipeline parallelism (engine.core keeps batches in flight):
        ``busy``, the ids of sequences whose sampling batch is still in the pipeline, which are
        skipped; ``max_seqs``, at most that many sequences in this batch."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        limit = max_seqs or self.config.max_num_seqs
        i = 0
        while i < len(self.running) and budget > 0 and len(out.scheduled) < limit:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if n <= 0 or (busy and seq.request_id in busy):
                i += 1
                continue
            while not self.kv.grow(seq, seq.num_computed_tokens + n):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.scheduled.append(ScheduledSeq(seq, n, seq.num_computed_tokens))
                budget -= n
                i += 1
                continue
            break  # seq itself was preempted: nothing after it remains in running
        if not out.preempted:
            forks: list[Sequence] = []  # waiting for a sibling to compute the prompt they share
            while (self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs
                   and len(out.scheduled) < limit):
                seq = self.waiting[0]
                if busy and seq.request_id in busy:  # preempted while in the pipeline: once it is back
                    break
                fresh = not seq.block_ids
                if fresh and not self.kv.admit(seq):
                    forks.append(self.waiting.popleft())
                    continue
                n = min(seq.num_tokens - seq.num_computed_tokens, budget)
                if not self.kv.grow(seq, seq.num_computed_tokens + n):
                    if fresh:
                        self.kv.free(seq)
                        seq.num_computed_tokens = 0
                    break
                self.waiting.popleft()
                seq.status = SequenceStatus.RUNNING
                if seq.metrics.first_scheduled_time is None:
                    seq.metrics.first_scheduled_time = time.monotonic()
                self.running.append(seq)
                out.scheduled.append(ScheduledSeq(seq, n, seq.num_computed_tokens))
                budget -= n
            self.waiting.extendleft(reversed(forks))
        return out

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.metrics.num_preemptions += 1
        self.waiting.appendleft(seq)

    def update(self, out: SchedulerOutput, sampled: dict[str, tuple[int, dict | None]]) -> list[Sequence]:
        """Advance computed tokens, append sampled tokens, finish what stopped.

        Returns the sequences that produced a token this step (finished or not).
        """
        produced = []
        for s in out.scheduled:
            seq = s.seq
            if seq.is_finished:  # aborted while the step ran
                continue
            # (max: a later chunk of the same prompt may already be in the pipeline, engine.core)
            seq.num_computed_tokens = max(seq.num_computed_tokens, s.start + s.num_new_tokens)
            self.kv.cache_full_blocks(seq)
            if not s.samples:
                continue
            token, logprobs = sampled[seq.request_id]
            seq.output_token_ids.append(token)
            if logprobs is not None:
                seq.output_logprobs.append(logprobs)
            produced.append(seq)
            if seq.grammar is not None and not seq.grammar.accept(token):  # the mask makes this a bug
                self.finish(seq, SequenceStatus.FINISHED_ERROR,
                            f"guided: sampled token {token} is outside the grammar")
                continue
            status = self.check_stop(seq, token)
            if status is not None:
                self.finish(seq, status)
        return produced

    def check_stop(self, seq: Sequence, token: int) -> SequenceStatus | None:
        """How ``token``, just appended, ends ``seq``; None if it goes on."""
        p = seq.params
        if seq.prefill_only:
            return SequenceStatus.FINISHED_LENGTH
        if not p.ignore_eos and token in seq.eos_token_ids:
            return SequenceStatus.FINISHED_STOPPED
        if token in p.stop_token_ids:
            return SequenceStatus.FINISHED_STOPPED
        if seq.grammar is not None and seq.grammar.is_terminated:  # took its stop token (ignore_eos or not)
            return SequenceStatus.FINISHED_STOPPED
        if len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.config.max_model_len:
            return SequenceStatus.FINISHED_LENGTH
        return None

    def finish(self, seq: Sequence, status: SequenceStatus, error: str | None = None) -> None:
        """Finish a sequence wherever it is; its blocks are freed unless it is
        prefill-only (the caller then owns and frees them)."""
        if seq.is_finished:
            return
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = status
        seq.error = error
        seq.metrics.finished_time = time.monotonic()
        if not (seq.prefill_only and status == SequenceStatus.FINISHED_LENGTH):
            self.kv.free(seq)

    def find(self, request_id: str) -> Sequence | None:
        for seq in self.running:
            if seq.request_id == request_id:
                return seq
        for seq in self.waiting:
            if seq.request_id == request_id:
                return seq
        return None
