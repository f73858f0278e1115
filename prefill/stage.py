"""The prefill stage: computes prompts and pushes their KV to decode replicas.

Life-cycle of a request in a prefill replica (frames of `engine.serving.frames`):

1. `Prefill`: the sequence enters the engine's waiting queue. The frontend
   sends it at the same moment as the decode replica's `Reserve`, so the
   ticket (the decode replica's endpoint, blocks and lease) comes a moment
   later, in an `Attach`; until then nothing can be sent, and once it came
   the ticket's lease is renewed while the prompt waits, so the reserved
   blocks on the decode side are not reclaimed.                 [waiting]
2. The engine batches prompts under the token budget, chunks long ones and
   reuses cached prefix blocks. When a batch holds a prompt's last chunk
   and its ticket is here, the KV sender starts that transfer before the
   forward pass, and the per-layer hook pushes layer i as soon as it is
   written, while layer i+1 computes. On CUDA, a ticket that comes while
   that pass runs is picked up between layers: the layers written so far go
   at once, the rest as they are written (`late_ticket_overlap`; on CPU it
   goes after the pass).                                    [transferring]
3. The first token is sampled (under the request's grammar, if guided:
   the sequence waits in the engine until its grammar compiled) and sent
   to the frontend at once, as a `FirstToken` with its text and logprobs,
   ahead of the transfer's outcome; the sender commits it to the decode replica, which streams
   from the second token on. The prompt's blocks stay held, since the
   sender still reads them. (A prompt computed before its ticket came is
   sent whole, all layers at once, when the ticket comes.)     [committing]
4. The sender reports DONE or FAILED: the blocks are freed (full ones stay
   in the prefix cache) and the frontend gets a `PrefillDone` with the
   error, if any, and this replica's timings.                       [done]
`Abort` at any point frees everything the request holds on this replica.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace

from engine.config import EngineConfig
from engine.kv_cache import model_fingerprint
from engine.output import OutputProcessor, prompt_logprobs
from engine.profiling import KV_COMMIT, KV_TRANSFER_START, phase
from engine.scheduler import SchedulerOutput
from engine.sequence import Sequence, SequenceStatus
from engine.serving.frames import Attach, FirstToken, Prefill, PrefillDone
from engine.serving.stage_loop import StageLoop, load_engine
from engine.serving.types import GenerateDelta, LoadReport, TokenLogprob
from kvtransfer.config import SenderConfig


@dataclass
class _Job:
    seq: Sequence
    ch: object  # the channel the request came by: its FirstToken and PrefillDone go there
    num_kv_tokens: int  # the tokens whose KV goes to the decode replica: the prompt and any output resumed after
    next_renew: float
    ticket: object | None = None
    sending: bool = False
    first_token: int | None = None  # sampled before the ticket came: send on attach


class PrefillStage(StageLoop):
    def __init__(self, replica_id: str, model_dir: str, engine_config: EngineConfig, sender: SenderConfig,
                 num_threads: int | None = None, late_ticket_overlap: bool | None = None, ranks=None):
        """``sender``: the KV sender's config; its lease_s also paces the renewals of queued requests' leases.

        ``late_ticket_overlap``: whether a ticket that comes while the
        prompt's forward pass runs starts the transfer between layers (True)
        or after the pass (False). None: on CUDA only, since on a CPU replica
        the transfer's copies and sends compete with the forward pass for the
        same cores and the GIL, and the first token does not wait for the
        transfer anyway (BENCHMARKS.md, "Measured design choices").

        ``ranks``: how the other tensor-parallel ranks start (`load_engine`).
        """
        from kvtransfer.layout import engine_kv
        from kvtransfer.sender import KVSender

        core, tokenizer = load_engine(model_dir, engine_config, num_threads, ranks)
        self.lease_s = sender.lease_s
        layout, self._kv_caches = engine_kv(core)  # every rank's cache, rank -> layer (one rank at TP=1)
        fingerprint = {**model_fingerprint(core.model_config, core.kv_spec), "weights": core.config.quantization}
        self.sender = KVSender(fingerprint, sender, layout=layout)  # weights: informational, not compared
        self._jobs: dict[str, _Job] = {}
        # tickets as they arrive (any thread), so a forward pass already under
        # way picks them up between layers instead of sending it all afterwards
        self._tickets_in: dict = {}
        self._tickets_lock = threading.Lock()
        self.num_kv_bytes_sent = 0  # of the transfers that ended DONE (the metrics' per-replica counter)
        self.late_ticket_overlap = (str(engine_config.device).startswith("cuda") if late_ticket_overlap is None
                                    else late_ticket_overlap)
        super().__init__(replica_id, core, tokenizer)

    # ---- frames ------------------------------------------------------------
    def _handlers(self):
        return {**super()._handlers(), Prefill: self._on_prefill, Attach: self._on_attach}

    def handle(self, ch, frame) -> None:
        if isinstance(frame, Attach):  # seen at once, so a forward pass under way can pick it up
            self._ticket_in(frame.request_id, frame.ticket)
        super().handle(ch, frame)

    def _ticket_in(self, request_id: str, ticket) -> None:
        """Any thread: a forward pass in progress picks the ticket up between layers (late_ticket_overlap)."""
        if self.late_ticket_overlap:
            with self._tickets_lock:
                self._tickets_in[request_id] = ticket

    # ---- loop thread -------------------------------------------------------
    def _on_prefill(self, ch, frame: Prefill) -> None:
        rid = frame.request_id
        if not self._route(ch, rid):
            return
        try:
            if rid in self._jobs:
                raise ValueError(f"request_id: {rid!r} is already running on {self.replica_id}")
            seq = Sequence(rid, list(frame.prompt_token_ids), frame.params, prefill_only=True,
                           output_token_ids=list(frame.output_token_ids),
                           fork_of=self._jobs[frame.fork_of].seq if frame.fork_of in self._jobs else None)
            self.core.add(seq)
        except Exception as e:
            self._refuse(ch, rid, e)
            return
        self._jobs[rid] = _Job(seq, ch, seq.num_tokens, time.monotonic() + self.lease_s / 3)

    def _on_attach(self, ch, frame: Attach) -> None:
        if frame.request_id in self._jobs:  # else it ended already (its Prefill came first, on this channel)
            self._attach(frame.request_id, frame.ticket)
        else:
            with self._tickets_lock:
                self._tickets_in.pop(frame.request_id, None)

    def _attach(self, request_id: str, ticket) -> None:
        with self._tickets_lock:
            self._tickets_in.pop(request_id, None)
        job = self._jobs[request_id]
        if job.sending:  # a forward pass picked the ticket up between layers
            return
        job.ticket = ticket
        if job.first_token is not None:  # computed already: send it whole now
            self._start_send(job)
            self._push_every_layer(request_id)
            with phase(KV_COMMIT):
                self.sender.commit(request_id, job.first_token)

    def _push_every_layer(self, request_id: str) -> None:
        for layer in range(self.sender.layout.num_layers):  # every global layer (PP: not only rank 0's)
            self.sender.push_layer(request_id, layer)

    def _start_send(self, job: _Job) -> None:
        seq = job.seq
        with phase(KV_TRANSFER_START):
            self.sender.start(job.ticket, self._kv_caches, seq.block_ids[: len(job.ticket.block_ids)],
                              job.num_kv_tokens)
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
                self.core.free_prefilled(job.seq)
            self._done(job, "aborted")

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
        with self._tickets_lock:  # (pipeline parallelism: an Attach handled while the batch was in the
            # pipeline set job.ticket already)
            arrived = [(job, self._tickets_in.pop(job.seq.request_id, None) or job.ticket) for job in waiting
                       if job.seq.request_id in self._tickets_in or job.ticket is not None]
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
                if out.seq.status == SequenceStatus.FINISHED_ERROR:  # its grammar did not compile
                    del self._jobs[out.seq.request_id]
                    self._refuse(job.ch, out.seq.request_id, out.seq.error)
                    continue
                if out.seq.status != SequenceStatus.FINISHED_LENGTH:
                    continue
                job.ch.send(self._first_token(out.seq, out.new_token_ids[0]))  # ahead of the transfer
                if not job.sending:
                    if job.ticket is None:  # no ticket yet: _attach sends it
                        job.first_token = out.new_token_ids[0]
                        continue
                    # the ticket came while the batch was in the pipeline, after its last layer hook
                    self._start_send(job)
                    self._push_every_layer(out.seq.request_id)
                with phase(KV_COMMIT):
                    self.sender.commit(out.seq.request_id, out.new_token_ids[0])
            busy = True
        for result in self.sender.poll():
            job = self._jobs.pop(result.request_id, None)
            if job is None:
                continue
            self.core.free_prefilled(job.seq)
            if result.status == "DONE":
                self.num_kv_bytes_sent += self._kv_bytes(job)
            self._done(job, None if result.status == "DONE" else result.error, result.finished_at)
        self._renew_leases()
        return busy

    def _first_token(self, seq: Sequence, token_id: int) -> FirstToken:
        """The text is what the decode replica's detokenizer, primed with this
        token, will also have emitted (`OutputProcessor.add`)."""
        text = OutputProcessor(self.tokenizer).add(seq, seq.output_token_ids)
        info = seq.output_logprobs[-1] if seq.output_logprobs else None
        return FirstToken(GenerateDelta(seq.request_id, [token_id], text,
                                        logprobs=[TokenLogprob.from_sampler(token_id, info)] if info else None,
                                        num_cached_tokens=seq.num_prefix_hit_tokens,
                                        prompt_logprobs=prompt_logprobs(seq, [token_id])))

    def _done(self, job: _Job, error: str | None, finished_at: float | None = None) -> None:
        """Tell the frontend the request is over here, with this replica's
        timings: the transfer's is what it added after the first token, to
        when it ended (``finished_at``; poll() may notice a forward pass later)."""
        self._routes.pop(job.seq.request_id, None)
        t = job.seq.metrics.timings()
        kv_time = None if finished_at is None or t.first_token is None else max(0.0, finished_at - t.first_token)
        job.ch.send(PrefillDone(job.seq.request_id, error,
                                replace(t, kv_transfer_time_s=kv_time, kv_transfer_bytes=self._kv_bytes(job))))

    def _kv_bytes(self, job: _Job) -> int:
        return len(job.ticket.block_ids) * self.core.kv_spec.bytes_per_block if job.ticket is not None else 0

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
            self._done(job, "prefill replica stopped")
        self._jobs.clear()
        self._routes.clear()

    def _snapshot_load(self) -> LoadReport:
        return self.core.load(self.replica_id, num_sending=sum(j.sending for j in self._jobs.values()),
                              num_kv_bytes_sent=self.num_kv_bytes_sent)
