"""The decode stage: reserves blocks, receives KV, generates.

Life-cycle of a request in a decode replica:

1. reserve(): blocks for the prompt are taken from the pool and registered
   with the KV receiver; the ticket (endpoint, block ids, lease) goes back
   to the caller, which hands it to a prefill replica.        [transferring]
2. Each loop round polls the receiver. DONE: the sequence joins the running
   batch with its first token (sampled by prefill) and that token is
   streamed. FAILED (peer died, lease expired, aborted): the blocks are
   already freed and the request ends with an error.            [running]
3. Each step appends a token to every running sequence; deltas go to the
   request's stream. Under block pressure the engine preempts the newest
   sequence and re-prefills it here later: never dropped.
4. Finish, abort or failure: the engine frees the blocks; the stream closes.

submit() takes a whole request and prefills it here: that is the colocated
mode (and conditional disaggregation for short prompts).
"""
from __future__ import annotations

import torch

from engine.config import EngineConfig
from engine.kv_cache import model_fingerprint
from engine.profiling import RECEIVER_POLL, phase
from engine.sampling import SamplingParams
from engine.core import StepOutput
from engine.sequence import Sequence
from engine.stage_loop import StageLoop, load_engine
from kvtransfer.config import ReceiverConfig


class DecodeStage(StageLoop):
    def __init__(self, replica_id: str, model_dir: str, engine_config: EngineConfig,
                 receiver: ReceiverConfig | None = None, num_threads: int | None = None):
        """``receiver``: None for a colocated replica, else the KV receiver's config."""
        core, tokenizer = load_engine(model_dir, engine_config, num_threads)
        self.receiver = None
        self.lease_s = 30.0
        if receiver is not None:
            from kvtransfer.receiver import KVReceiver

            self.lease_s = receiver.lease_s
            self.receiver = KVReceiver(core.kv_caches, core.pool, model_fingerprint(core.model_config, core.kv_spec),
                                       receiver)
        self._incoming: dict[str, Sequence] = {}  # reserved, waiting for their KV
        super().__init__(replica_id, core, tokenizer)

    @property
    def endpoint(self) -> str | None:
        return self.receiver.endpoint if self.receiver else None

    # ---- API (any thread) --------------------------------------------------
    def reserve(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams):
        """Reserve blocks for a prompt whose KV a prefill replica will push; returns the Ticket."""
        if self.receiver is None:
            raise RuntimeError(f"{self.replica_id} is colocated: it takes submit(), not reserve()")
        self.core.check_prompt(prompt_token_ids, params.max_tokens)
        self.open_stream(request_id)
        try:
            return self.call(self._reserve, request_id, prompt_token_ids, params)
        except BaseException:
            self.abort(request_id)
            raise

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Take a whole request (prefill here too)."""
        self.core.check_prompt(prompt_token_ids, params.max_tokens)
        self.open_stream(request_id)
        try:
            self.call(self._submit, request_id, prompt_token_ids, params)
        except BaseException:
            self.abort(request_id)
            raise

    def renew(self, request_id: str, lease_s: float) -> None:
        self.post(self._renew, request_id, lease_s)

    # ---- loop thread -------------------------------------------------------
    def _reserve(self, request_id, prompt_token_ids, params):
        ticket = self.receiver.reserve(request_id, len(prompt_token_ids), self.lease_s)
        self._incoming[request_id] = Sequence(request_id, list(prompt_token_ids), params)
        return ticket

    def _submit(self, request_id, prompt_token_ids, params):
        seq = Sequence(request_id, list(prompt_token_ids), params)
        self.core.add(seq)
        self.outputs.add(seq)

    def _channel_ops(self):
        return dict(super()._channel_ops(), submit=self._ch_submit, reserve=self._ch_reserve)

    def _ch_submit(self, ch, request_id, prompt_token_ids, params):
        if not self._route(ch, request_id):
            return
        try:
            self.core.check_prompt(prompt_token_ids, params.max_tokens)
            self._submit(request_id, prompt_token_ids, params)
        except Exception as e:
            self._release(request_id)
            self._refuse(ch, request_id, e)

    def _ch_reserve(self, ch, request_id, prompt_token_ids, params):
        if not self._route(ch, request_id):
            return
        try:
            if self.receiver is None:
                raise RuntimeError(f"{self.replica_id} is colocated: it takes submit, not reserve")
            self.core.check_prompt(prompt_token_ids, params.max_tokens)
            ticket = self._reserve(request_id, prompt_token_ids, params)
        except Exception as e:
            self._release(request_id)
            self._refuse(ch, request_id, e)
            return
        ch.send(("ticket", request_id, ticket))

    def _renew(self, request_id, lease_s):
        if request_id in self._incoming:
            self.receiver.renew(request_id, lease_s)

    def _release(self, request_id: str) -> None:
        if self._incoming.pop(request_id, None) is not None:
            self.receiver.abort(request_id)  # frees the reserved blocks; the next poll() reaps it
        super()._release(request_id)

    def _iterate(self) -> bool:
        if self.receiver is not None:
            with phase(RECEIVER_POLL):
                results = self.receiver.poll()
            for result in results:
                seq = self._incoming.pop(result.request_id, None)
                if seq is None:
                    if result.status == "DONE":  # aborted as its last chunk landed: the blocks are ours to free
                        self.core.pool.free(self.receiver.release(result.request_id))
                    continue
                if result.status == "DONE":
                    self._admit(seq, self.receiver.release(result.request_id), result.first_token)
                else:
                    self.fail_request(seq.request_id, f"KV transfer failed: {result.error}")
        if not self.core.has_unfinished():
            return False
        self.emit_outputs(self.core.step())
        return True

    def _admit(self, seq: Sequence, block_ids: list[int], first_token: int) -> None:
        seq.block_ids = block_ids
        seq.output_token_ids.append(first_token)
        if seq.generator is not None:
            # the prefill replica drew once from this seed; draw once too so
            # the rest of the stream matches a colocated run
            torch.empty(self.core.model_config.vocab_size).exponential_(generator=seq.generator)
        self.core.add_prefilled(seq)
        self.outputs.add(seq)
        stop = self.core.scheduler.check_stop(seq, first_token)
        if stop is not None:
            self.core.finish(seq, stop)
        self.emit_outputs([StepOutput(seq, [first_token], seq.is_finished)])

    def _has_pending(self) -> bool:
        return bool(self._incoming)

    def _on_stop(self) -> None:
        if self.receiver is not None:
            self.receiver.close()

    def close(self) -> None:
        self.stop()

    def _snapshot_load(self) -> dict:
        load = super()._snapshot_load()
        load["num_incoming"] = len(self._incoming)
        return load
