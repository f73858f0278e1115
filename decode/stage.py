"""The decode stage: reserves blocks, receives KV, generates.

Life-cycle of a request in a decode replica (frames of `engine.serving.frames`):

1. `Reserve`: blocks for the prompt are taken from the pool and registered
   with the KV receiver; the ticket (endpoint, block ids, lease) goes back
   to the frontend in a `TicketReady`, which passes it on to the prefill
   replica. While the pool is short, reservations wait in arrival order
   (a lease at most, then they are refused).                    [waiting]
                                                           [transferring]
2. Each loop round polls the receiver. DONE: the sequence is admitted with
   its first token, which the prefill replica sampled and already sent to
   the client (`EngineCore.admit_prefilled`; the detokenizer is primed
   with it), so this replica streams from the second token on. FAILED (peer
   died, lease expired, aborted): the blocks are already freed and the
   request ends with an error. A `PrefillLost` (the frontend saw the
   sender's replica go after the first token) fails an unfinished
   transfer at once rather than at the end of its lease. A guided
   request joins the batch once its grammar (compiled from the `Reserve`
   on) is ready, its state rebuilt from its output so far.     [running]
3. Each step appends a token to every running sequence; one `Deltas` frame
   per step carries them. Under block pressure the engine preempts the
   newest sequence and re-prefills it here later: never dropped.
4. Finish, abort or failure: the engine frees the blocks; the request's
   last delta has its finish reason.

`Submit` takes a whole request and prefills it here: that is the colocated
mode (and conditional disaggregation for short prompts).

A `Submit` with ``fork_of`` is choice j > 0 of a request with n > 1 whose
choice 0 was reserved here: one prefill, one transfer, n sequences. The fork
waits (``_forks``) until its sibling's KV has landed and is admitted, then
joins the engine as a fork of it (`KVCacheManager.admit`): it shares the
prompt's full blocks, reference-counted, computes only the prompt's last
partial block into a block of its own (as a colocated fork does, so the
same seed draws the same tokens), and samples its own first token. A fork
whose sibling ended here without its KV (transfer failed, aborted) computes
the whole prompt here instead (once: the others fork from it).

Why the decode side samples each fork's first token rather than the
prefill replica sampling n of them from the one set of logits: a fork's
first draw is then the same computation as a colocated fork's (its own
last partial block, then the draw for output position 0 from its own seed,
`engine.sampler`), so seeded choices equal a colocated cluster's and stay a
function of (seed, position), which migration relies on; and the transfer
keeps one first token per commit. It costs each fork at most one block of
prompt tokens, computed here.
"""
from __future__ import annotations

import time
from collections import deque

from engine.block_pool import NoFreeBlocksError
from engine.config import EngineConfig
from engine.core import StepOutput
from engine.kv_cache import model_fingerprint
from engine.profiling import RECEIVER_POLL, phase
from engine.sequence import Sequence
from engine.serving.frames import PrefillLost, Reserve, Submit, TicketReady
from engine.serving.stage_loop import StageLoop, load_engine
from engine.serving.types import LoadReport
from kvtransfer.config import ReceiverConfig


class DecodeStage(StageLoop):
    def __init__(self, replica_id: str, model_dir: str, engine_config: EngineConfig,
                 receiver: ReceiverConfig | None = None, num_threads: int | None = None, ranks=None):
        """``receiver``: None for a colocated replica, else the KV receiver's config.
        ``ranks``: how the other tensor-parallel ranks start (`load_engine`)."""
        core, tokenizer = load_engine(model_dir, engine_config, num_threads, ranks)
        self.receiver = None
        self.lease_s = 30.0
        if receiver is not None:
            from kvtransfer.layout import engine_kv
            from kvtransfer.receiver import KVReceiver

            self.lease_s = receiver.lease_s
            layout, caches = engine_kv(core)  # every rank's cache, rank -> layer (one rank at TP=1)
            # weights: informational, not compared (kvtransfer.auth.INFORMATIONAL_FIELDS)
            fingerprint = {**model_fingerprint(core.model_config, core.kv_spec), "weights": core.config.quantization}
            self.receiver = KVReceiver(caches, core.pool, fingerprint, receiver, layout=layout)
        self._incoming: dict[str, Sequence] = {}  # reserved, waiting for their KV
        # reservations waiting for free blocks, oldest first: (sequence, channel, deadline)
        self._waiting: deque[tuple[Sequence, object, float]] = deque()
        # forks waiting for the sibling whose KV is coming: sibling's request id -> [fork, ...]
        self._forks: dict[str, list[Sequence]] = {}
        super().__init__(replica_id, core, tokenizer)

    @property
    def endpoint(self) -> str | None:
        return self.receiver.endpoint if self.receiver else None

    # ---- frames (loop thread) ----------------------------------------------
    def _handlers(self):
        return {**super()._handlers(), Submit: self._on_submit, Reserve: self._on_reserve,
                PrefillLost: self._on_prefill_lost}

    def _on_submit(self, ch, frame: Submit) -> None:
        if not self._route(ch, frame.request_id):
            return
        try:
            seq = Sequence(frame.request_id, list(frame.prompt_token_ids), frame.params,
                           output_token_ids=list(frame.output_token_ids),
                           fork_of=self.core.get(frame.fork_of) if frame.fork_of else None)
            if frame.fork_of and self._is_coming(frame.fork_of):
                self.core.check_prompt(seq.token_ids, frame.params.max_tokens - seq.num_output_tokens)
                self._forks.setdefault(frame.fork_of, []).append(seq)
                return
            self._add(seq)
        except Exception as e:
            self._refuse(ch, frame.request_id, e)

    def _is_coming(self, request_id: str) -> bool:
        """Reserved here (or waiting for blocks), its KV not yet admitted."""
        return request_id in self._incoming or any(w[0].request_id == request_id for w in self._waiting)

    def _add(self, seq: Sequence) -> None:
        self.core.add(seq)
        self.outputs.add(seq, seq.output_token_ids)

    def _start_forks(self, request_id: str, sibling: Sequence | None) -> None:
        """The forks of ``request_id`` join the engine: as forks of ``sibling``, just admitted with the
        prompt's KV, or (None: it ended without it) of the first of them, which computes the prompt here."""
        lead = sibling
        for seq in self._forks.pop(request_id, ()):
            seq.fork_of = lead
            try:
                self._add(seq)
            except Exception as e:
                ch = self._routes.get(seq.request_id)
                if ch is not None:
                    self._refuse(ch, seq.request_id, e)
                continue
            lead = lead or seq

    def _on_reserve(self, ch, frame: Reserve) -> None:
        rid = frame.request_id
        if not self._route(ch, rid):
            return
        try:
            if self.receiver is None:
                raise RuntimeError(f"{self.replica_id} is colocated: it takes Submit, not Reserve")
            seq = Sequence(rid, list(frame.prompt_token_ids), frame.params,
                           output_token_ids=list(frame.output_token_ids))
            self.core.check_prompt(seq.token_ids, frame.params.max_tokens - seq.num_output_tokens)
            self.core.prepare_grammar(frame.params)  # compiles while the KV comes; admitted once both are in
        except Exception as e:
            self._refuse(ch, rid, e)
            return
        self._waiting.append((seq, ch, time.monotonic() + self.lease_s))
        self._reserve_waiting()

    def _reserve_waiting(self) -> None:
        """Reserve blocks for the waiting reservations, oldest first, while
        the pool has them; one that waited a whole lease is refused."""
        while self._waiting:
            seq, ch, deadline = self._waiting[0]
            try:
                ticket = self.receiver.reserve(seq.request_id, seq.num_tokens, self.lease_s)  # every token so far
            except NoFreeBlocksError as e:
                if time.monotonic() < deadline:
                    return  # blocks come back as requests end
                self._waiting.popleft()
                self._refuse(ch, seq.request_id, f"no KV blocks free for {self.lease_s:g}s: {e}")
                self._start_forks(seq.request_id, None)
                continue
            except Exception as e:
                self._waiting.popleft()
                self._refuse(ch, seq.request_id, e)
                self._start_forks(seq.request_id, None)
                continue
            self._waiting.popleft()
            self._incoming[seq.request_id] = seq
            ch.send(TicketReady(seq.request_id, ticket))

    def _on_prefill_lost(self, ch, frame: PrefillLost) -> None:
        """Its KV's sender is gone: fail the transfer now unless it is DONE (then the next poll admits it).
        A reservation still waiting for blocks ends too: its ticket never reached the sender."""
        rid, why = frame.request_id, f"prefill replica {frame.replica_id} was lost"
        if rid in self._incoming:
            self.receiver.abort(rid, why)  # the next poll() reports it FAILED, or DONE if it landed whole
        elif self._is_coming(rid):  # still waiting for blocks
            self._release(rid)
            self.fail_request(rid, f"KV transfer failed: {why}")

    def _release(self, request_id: str) -> None:
        if self._incoming.pop(request_id, None) is not None:
            self.receiver.abort(request_id)  # frees the reserved blocks; the next poll() reaps it
        self._waiting = deque(w for w in self._waiting if w[0].request_id != request_id)
        for sibling, forks in list(self._forks.items()):
            kept = [f for f in forks if f.request_id != request_id]
            if kept:
                self._forks[sibling] = kept
            else:
                del self._forks[sibling]
        if request_id in self._forks:  # its KV will not come: its forks compute the prompt here
            self._start_forks(request_id, None)
        super()._release(request_id)

    def _iterate(self) -> bool:
        if self._waiting:
            self._reserve_waiting()
        if self.receiver is not None:
            with phase(RECEIVER_POLL):
                results = self.receiver.poll()
            for result in results:
                seq = self._incoming.pop(result.request_id, None)
                if seq is None:
                    if result.status == "DONE":  # aborted as its last chunk landed: the blocks are ours to free
                        self.core.free_blocks(self.receiver.release(result.request_id))
                    continue
                if result.status == "DONE":
                    self._admit(seq, self.receiver.release(result.request_id), result.first_token)
                else:
                    self._start_forks(seq.request_id, None)
                    self.fail_request(seq.request_id, f"KV transfer failed: {result.error}")
        if not self.core.has_unfinished():
            return False
        self.emit_outputs(self.core.step())
        return True

    def _admit(self, seq: Sequence, block_ids: list[int], first_token: int) -> None:
        """The prefilled sequence joins the running batch; its first token is
        the client's already, so nothing is emitted for it unless it also
        ended the request (then the last delta: the finish reason, and any
        text the detokenizer held back)."""
        finished = self.core.admit_prefilled(seq, block_ids, first_token)
        self.outputs.add(seq, seq.output_token_ids)
        # its forks share the prompt's full blocks (or, if the first token ended it, find them in the
        # prefix cache where it is on; else they compute the prompt here)
        self._start_forks(seq.request_id, seq)
        if finished or self.outputs.is_stopped(seq.request_id):
            self.emit_outputs([StepOutput(seq, [])])

    def _has_pending(self) -> bool:
        return bool(self._incoming or self._waiting or self._forks)

    def _on_stop(self) -> None:
        if self.receiver is not None:
            self.receiver.close()

    def _snapshot_load(self) -> LoadReport:
        return self.core.load(self.replica_id, num_incoming=len(self._incoming) + len(self._waiting))
