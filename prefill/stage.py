"""The prefill stage: computes prompts and pushes their KV to decode replicas.

Life-cycle of a request in a prefill replica:

1. prefill(request, ticket): the sequence enters the engine's waiting queue
   with the decode replica's ticket, or without one: the caller may start
   the prompt while the decode replica is still reserving and attach the
   ticket a moment later (attach_ticket), taking that round trip off the
   time to first token. While it waits, the ticket's lease is renewed so
   the reserved blocks on the decode side are not reclaimed.       [waiting]
2. The engine batches prompts under the token budget, chunks long ones and
   reuses cached prefix blocks. When a batch holds a prompt's last chunk,
   the KV sender starts that transfer before the forward pass, and the
   per-layer hook pushes layer i as soon as it is written, while layer i+1
   computes. On CUDA, a ticket that comes while that pass runs (the usual
   case when the caller starts the prompt first) is picked up between
   layers: the layers written so far go at once, the rest as they are
   written (`late_ticket_overlap`; on CPU it goes after the pass).
                                                              [transferring]
3. The first token is sampled and committed; the prompt's blocks stay held,
   since the sender still reads them. (A prompt that finished before its
   ticket came is sent whole, all layers at once, when it comes.) The
   caller of prefill_stream() gets the token at once, with its text and
   logprobs, ahead of the transfer's outcome.                  [committing]
4. The sender reports DONE or FAILED: the blocks are freed (full ones stay
   in the prefix cache) and the caller gets the result: the first token or
   the error.                                                        [done]
Abort at any point frees everything the request holds on this replica.
"""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.kv_cache import model_fingerprint
from engine.profiling import KV_COMMIT, KV_TRANSFER_START, phase
from engine.sampling import SamplingParams
from engine.scheduler import SchedulerOutput
from engine.sequence import Sequence, SequenceStatus
from engine.stage_loop import StageLoop, load_engine
from engine.channel import FirstToken
from kvtransfer.config import SenderConfig


@dataclass
class PrefillResult:
    request_id: str
    status: str  # "DONE" | "FAILED"
    first_token: int | None = None
    logprobs: dict | None = None
    error: str | None = None
    num_cached_tokens: int = 0
    timings: dict = field(default_factory=dict)  # queue_time_s, prefill_time_s, kv_transfer_time_s, kv_transfer_bytes,
    # wall_times: {prefill_queued, prefill_start, prefill_end} as time.time() stamps


@dataclass
class _Job:
    seq: Sequence
    ticket: object
    events: queue.SimpleQueue | "_ChannelEvents"  # the caller's FirstToken, then its PrefillResult
    next_renew: float
    sending: bool = False
    compute_done: float | None = None
    first_token: int | None = None  # sampled before the ticket came: send on attach


class _ChannelEvents:
    """A job's events sent back over the request channel it came by."""

    def __init__(self, ch, request_id: str):
        self.ch = ch
        self.request_id = request_id

    def put(self, item) -> None:
        self.ch.send(("first" if isinstance(item, FirstToken) else "result", self.request_id, item))


class PrefillStage(StageLoop):
    def __init__(self, replica_id: str, model_dir: str, engine_config: EngineConfig, sender: SenderConfig,
                 num_threads: int | None = None, late_ticket_overlap: bool | None = None):
        """``sender``: the KV sender's config; its lease_s also paces the renewals of queued requests' leases.

        ``late_ticket_overlap``: whether a ticket that comes while the
        prompt's forward pass runs starts the transfer between layers (True)
        or after the pass (False). None: on CUDA only. On a CPU replica the
        transfer's copies and sends compete with the forward pass for the
        same cores and the GIL: on 2 vCPUs, one served request (~40 prompt
        tokens, runs alternating off and on) had a TTFT of 75-80 ms off and
        101 ms on, for 3.0-4.9 instead of 4.5-8.3 ms of transfer after the
        pass; and the first token does not wait for the transfer anyway.
        """
        from kvtransfer.sender import KVSender

        core, tokenizer = load_engine(model_dir, engine_config, num_threads)
        self.lease_s = sender.lease_s
        self.sender = KVSender(model_fingerprint(core.model_config, core.kv_spec), sender)
        self._jobs: dict[str, _Job] = {}
        self._early_tickets: dict = {}  # attach_ticket() that overtook its prefill()
        # tickets as they arrive (any thread), so a forward pass already under
        # way picks them up between layers instead of sending it all afterwards
        self._tickets_in: dict = {}
        self._tickets_lock = threading.Lock()
        self.late_ticket_overlap = (str(engine_config.device).startswith("cuda") if late_ticket_overlap is None
                                    else late_ticket_overlap)
        super().__init__(replica_id, core, tokenizer)

    # ---- API (any thread) --------------------------------------------------
    def prefill(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, ticket=None,
                timeout_s: float = 600.0) -> PrefillResult:
        """Compute the prompt and push its KV into ``ticket``'s blocks (None:
        the ticket comes through attach_ticket). Blocks until the transfer is
        DONE or FAILED; returns the first token."""
        for item in self.prefill_stream(request_id, prompt_token_ids, params, ticket, timeout_s=timeout_s):
            if isinstance(item, PrefillResult):
                return item
        raise AssertionError("prefill_stream ends with a PrefillResult")

    def prefill_stream(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, ticket=None,
                       timeout_s: float = 600.0) -> Iterator[FirstToken | PrefillResult]:
        """prefill(), streamed: yields the `engine.channel.FirstToken` as
        soon as it is sampled (unless the request fails first), then the
        `PrefillResult`."""
        self.core.check_prompt(prompt_token_ids, 1)
        events: queue.SimpleQueue = queue.SimpleQueue()
        self.call(self._add, request_id, prompt_token_ids, params, ticket, events)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                item = events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.abort(request_id)
                yield PrefillResult(request_id, "FAILED", error=f"prefill did not finish within {timeout_s}s")
                return
            yield item
            if isinstance(item, PrefillResult):
                return

    def attach_ticket(self, request_id: str, ticket) -> None:
        """The decode replica's ticket for a prefill() started without one."""
        self._ticket_in(request_id, ticket)
        self.post(self._attach, request_id, ticket)

    def _on_channel_command(self, ch, msg: tuple) -> None:
        if msg[0] == "attach":
            self._ticket_in(msg[1], msg[2])
        super()._on_channel_command(ch, msg)

    def _ticket_in(self, request_id: str, ticket) -> None:
        """Any thread: a forward pass in progress picks the ticket up between layers (late_ticket_overlap)."""
        if self.late_ticket_overlap:
            with self._tickets_lock:
                self._tickets_in[request_id] = ticket

    # ---- loop thread -------------------------------------------------------
    def _add(self, request_id, prompt_token_ids, params, ticket, events) -> None:
        seq = Sequence(request_id, list(prompt_token_ids), params, prefill_only=True)
        self.core.add(seq)
        ticket = ticket or self._early_tickets.pop(request_id, None)
        self._jobs[request_id] = _Job(seq, ticket, events, time.monotonic() + self.lease_s / 3)

    def _channel_ops(self):
        return dict(super()._channel_ops(), prefill=self._ch_prefill, attach=self._ch_attach)

    def _ch_attach(self, ch, request_id, ticket) -> None:
        if request_id in self._jobs:  # else it ended already (its prefill command came first, on this channel)
            self._attach(request_id, ticket)
        else:
            with self._tickets_lock:
                self._tickets_in.pop(request_id, None)

    def _ch_prefill(self, ch, request_id, prompt_token_ids, params) -> None:
        if not self._route(ch, request_id):
            return
        try:
            if request_id in self._jobs:
                raise ValueError(f"request_id: {request_id!r} is already running on {self.replica_id}")
            self.core.check_prompt(prompt_token_ids, 1)
            self._add(request_id, prompt_token_ids, params, None, _ChannelEvents(ch, request_id))
        except Exception as e:
            self._refuse(ch, request_id, e)

    def _attach(self, request_id: str, ticket) -> None:
        with self._tickets_lock:
            self._tickets_in.pop(request_id, None)
        job = self._jobs.get(request_id)
        if job is None:
            self._early_tickets[request_id] = ticket
            return
        if job.sending:  # a forward pass picked the ticket up between layers
            return
        job.ticket = ticket
        if job.first_token is not None:  # computed already: send it whole now
            self._start_send(job)
            for layer in range(len(self.core.kv_caches)):
                self.sender.push_layer(request_id, layer)
            with phase(KV_COMMIT):
                self.sender.commit(request_id, job.first_token)

    def _start_send(self, job: _Job) -> None:
        seq = job.seq
        with phase(KV_TRANSFER_START):
            self.sender.start(job.ticket, self.core.kv_caches, seq.block_ids[: len(job.ticket.block_ids)],
                              seq.num_prompt_tokens)
        job.sending = True

    def _abort(self, request_id: str) -> None:
        job = self._jobs.get(request_id)
        if job is None:
            return
        if job.sending:
            self.sender.abort(request_id)  # poll() reports FAILED, then the blocks are freed
        else:
            self._jobs.pop(request_id)
            if self.core.abort(request_id) is None:  # computed, waiting for its ticket
                self.core.kv.free(job.seq)
            job.events.put(PrefillResult(request_id, "FAILED", error="aborted"))
            self._routes.pop(request_id, None)

    def _on_batch(self, sched: SchedulerOutput):
        starting, waiting = [], []  # prompts ending in this batch, with and without a ticket
        for s in sched.scheduled:
            job = self._jobs.get(s.seq.request_id)
            if job is None or not s.samples:
                continue
            if job.ticket is None:
                if self.late_ticket_overlap:
                    waiting.append(job)
                continue
            self._start_send(job)
            starting.append(job.seq.request_id)
        if not starting and not waiting:
            return None
        push = self.sender.push_layer

        def hook(layer: int) -> None:
            for rid in starting:
                push(rid, layer)
            if waiting:
                self._pick_up_tickets(waiting, starting, layer)
        return hook

    def _pick_up_tickets(self, waiting: list, starting: list, layer: int) -> None:
        """In the layer hook: tickets that came while this forward pass runs
        start their transfer now, with the layers written so far, and the
        rest follow layer by layer (the ticket usually comes a moment after
        the prompt, once the pass has begun)."""
        with self._tickets_lock:
            arrived = [(job, self._tickets_in.pop(job.seq.request_id)) for job in waiting
                       if job.seq.request_id in self._tickets_in]
        for job, ticket in arrived:
            waiting.remove(job)
            job.ticket = ticket
            self._start_send(job)
            rid = job.seq.request_id
            for done_layer in range(layer + 1):
                self.sender.push_layer(rid, done_layer)
            starting.append(rid)

    def _iterate(self) -> bool:
        busy = False
        if self.core.has_unfinished():
            for out in self.core.step(self._on_batch):
                job = self._jobs.get(out.seq.request_id)
                if job is None:
                    continue
                job.compute_done = time.monotonic()
                if out.seq.status != SequenceStatus.FINISHED_LENGTH:
                    continue
                job.events.put(self._first_token(out.seq, out.new_token_ids[0]))  # ahead of the transfer
                if not job.sending:  # no ticket yet: _attach sends it
                    job.first_token = out.new_token_ids[0]
                    continue
                with phase(KV_COMMIT):
                    self.sender.commit(out.seq.request_id, out.new_token_ids[0])
            busy = True
        for result in self.sender.poll():
            job = self._jobs.pop(result.request_id, None)
            if job is None:
                continue
            self.core.kv.free(job.seq)
            job.events.put(self._result(job, result))
            self._routes.pop(result.request_id, None)
        self._renew_leases()
        return busy

    def _first_token(self, seq: Sequence, token_id: int) -> FirstToken:
        text = ""
        if self.tokenizer is not None:
            from engine.tokenizer import IncrementalDetokenizer

            detok = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids,
                                           skip_special_tokens=seq.params.skip_special_tokens, stop=seq.params.stop)
            text = detok.step([token_id])
        return FirstToken(seq.request_id, token_id, text, seq.output_logprobs[0] if seq.output_logprobs else None,
                          seq.num_prefix_hit_tokens)

    def _result(self, job: _Job, result) -> PrefillResult:
        seq = job.seq
        m = seq.metrics
        now = time.monotonic()
        timings = {}
        if m.first_scheduled_time is not None:
            timings["queue_time_s"] = m.first_scheduled_time - m.arrival_time
            if job.compute_done is not None:
                timings["prefill_time_s"] = job.compute_done - m.first_scheduled_time
                # what the transfer added after compute, to when it ended (poll() may come a forward pass later)
                ended = now - (time.time() - result.finished_at)
                timings["kv_transfer_time_s"] = max(0.0, ended - job.compute_done)
        timings["kv_transfer_bytes"] = len(job.ticket.block_ids) * self.core.kv_spec.bytes_per_block
        wall = m.wall_times()  # for a request timeline: queued here, prefill start and end
        timings["wall_times"] = {"prefill_queued": wall["arrival"]}
        if "first_scheduled" in wall:
            timings["wall_times"]["prefill_start"] = wall["first_scheduled"]
        if job.compute_done is not None:
            timings["wall_times"]["prefill_end"] = job.compute_done + (time.time() - now)
        if result.status != "DONE":
            return PrefillResult(seq.request_id, "FAILED", error=result.error, timings=timings)
        return PrefillResult(seq.request_id, "DONE", result.first_token,
                             seq.output_logprobs[0] if seq.output_logprobs else None,
                             num_cached_tokens=seq.num_prefix_hit_tokens, timings=timings)

    def _renew_leases(self) -> None:
        now = time.monotonic()
        for job in self._jobs.values():
            if not job.sending and job.ticket is not None and now >= job.next_renew:
                self.sender.renew(job.ticket, self.lease_s)
                job.next_renew = now + self.lease_s / 3

    def _has_pending(self) -> bool:
        return bool(self._jobs)

    def _on_stop(self) -> None:
        self.sender.close()
        for job in list(self._jobs.values()):
            job.events.put(PrefillResult(job.seq.request_id, "FAILED", error="prefill replica stopped"))
        self._jobs.clear()
        self._routes.clear()

    def close(self) -> None:
        self.stop()

    def _snapshot_load(self) -> dict:
        load = super()._snapshot_load()
        load["num_sending"] = sum(j.sending for j in self._jobs.values())
        return load
