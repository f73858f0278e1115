"""EngineCore: one model, one KV cache, one scheduler; step() = schedule →
execute → update. Used by the offline LLM and by both serving stages."""
from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass

import torch

from engine.block_pool import BlockPool
from engine.config import ConfigError, EngineConfig, ModelConfig
from engine.guided import GrammarCompiler, GrammarState
from engine.kv_cache import KVCacheSpec, allocate_kv_cache, torch_dtype
from engine.kv_manager import KVCacheManager
from engine.model import LayerHook, LlamaModel
from engine.profiling import SCHEDULE, UPDATE, phase
from engine.runner import ModelRunner
from engine.sampling import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from engine.sequence import Sequence, SequenceStatus
from engine.serving.types import LoadReport

log = logging.getLogger(__name__)


def pick_dtype(name: str, device: str, quantization: str = "none") -> str:
    """`auto`: bf16 where the hardware runs it fast (CUDA; CPUs where a native kernel
    ISA path builds, AVX2 included, or with AMX: `engine.kernels.cpu_runs_bf16_fast`), else fp32.
    Quantized weights always compute with fp32 activations (and an fp32 KV cache)."""
    if name != "auto":
        return name
    if quantization != "none":
        return "float32"
    if device.startswith("cuda"):
        return "bfloat16"
    from engine.kernels import cpu_runs_bf16_fast

    return "bfloat16" if cpu_runs_bf16_fast() else "float32"


@dataclass
class StepOutput:
    seq: Sequence
    new_token_ids: list[int]


@dataclass
class InFlightBatch:
    """A batch launched down the pipeline (pipeline_parallel_size > 1), not yet back."""

    sched: SchedulerOutput
    handle: object  # engine.parallel.runner.InFlight
    preemptions: list[int]  # each scheduled sequence's preemption count at launch


class EngineCore:
    def __init__(self, model_config: ModelConfig, weights: dict[str, torch.Tensor], config: EngineConfig,
                 tp_group=None):
        """``weights``: the whole checkpoint, or with tensor_parallel_size > 1 rank 0's shard, with
        ``tp_group`` (engine.parallel.TPGroup) the other ranks: use engine.parallel.start_engine."""
        config.validate()
        from engine.parallel.sharding import ShardLayout

        shard = ShardLayout.for_engine(model_config, 0, config)
        if shard.is_sharded and tp_group is None:
            raise ConfigError("tensor_parallel_size: > 1 needs its group of ranks (engine.parallel.start_engine)")
        self.pp_size = pp = config.pipeline_parallel_size
        if pp > 1 and tp_group is None:
            raise ConfigError("pipeline_parallel_size: > 1 needs its group of ranks (engine.parallel.start_engine)")
        self.config = config
        self.model_config = model_config
        self.dtype_name = pick_dtype(config.dtype, config.device, config.quantization)
        dtype = torch_dtype(self.dtype_name)
        self.max_model_len = config.max_model_len or model_config.max_position_embeddings
        if self.max_model_len > model_config.max_position_embeddings:
            raise ConfigError(
                f"max_model_len: {self.max_model_len} exceeds the model's context "
                f"({model_config.max_position_embeddings})")
        self.model = LlamaModel(model_config, weights, dtype, config.device, max_positions=self.max_model_len,
                                kernel_isa=config.kernel_isa, shard=shard, moe_dispatch=config.moe_dispatch,
                                comm=tp_group.comm if tp_group is not None else None,
                                quantization=config.quantization)
        self.kv_spec = KVCacheSpec.for_model(model_config, config.block_size, self.dtype_name,
                                             num_kv_heads=shard.num_kv_heads,
                                             num_layers=len(shard.layers))  # this rank's heads and layers
        # every stage holds as many blocks: sized for the stage with the most layers
        from engine.parallel.sharding import pipeline_layers

        most = max(len(r) for r in pipeline_layers(model_config.num_layers, pp, config.pipeline_layer_split))
        budget_spec = KVCacheSpec.for_model(model_config, config.block_size, self.dtype_name,
                                            num_kv_heads=shard.num_kv_heads, num_layers=most)
        num_blocks = config.num_kv_blocks or budget_spec.num_blocks_for_memory(config.kv_cache_memory_gb)
        # (a mixture of experts sizes its per-expert batches on the host: no graph capture)
        graphs = config.device.startswith("cuda") and not config.enforce_eager and not model_config.is_moe
        if graphs and tp_group is not None:
            # a captured step would hold NCCL all-reduces that every rank must replay in lockstep, and the
            # other ranks run their steps eagerly (engine.parallel.worker): TP>1 on CUDA runs eagerly
            log.info("CUDA graphs off at tensor_parallel_size %d: the other ranks run decode steps eagerly, "
                     "and a graph's NCCL all-reduces would need every rank to replay the same graph",
                     config.tensor_parallel_size)
            graphs = False
        # with CUDA graphs, one block past the pool's is where padded batch rows write
        self.kv_caches = allocate_kv_cache(self.kv_spec, num_blocks + graphs, config.device,
                                           prefault=config.kv_cache_prefault)
        self.pool = BlockPool(num_blocks, config.enable_prefix_caching)
        self.kv = KVCacheManager(self.pool, config.block_size)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len), self.kv)
        self.tp_group = tp_group
        # pipeline parallelism: batches launched down the pipeline, oldest first, not yet collected, and
        # the sequences whose sampling chunk is among them (never scheduled again until it is back)
        self._in_flight: deque[InFlightBatch] = deque()
        self._busy: set[str] = set()
        if pp > 1:
            from engine.parallel.runner import PPRunner

            self.runner = PPRunner(self.model, self.kv_caches, config.block_size, config.seed, tp_group)
            tp_group.pipe.share_expert_counts(self.model)  # every stage's layers' load, for expert_load
        elif tp_group is not None:
            from engine.parallel.runner import TPRunner

            self.runner = TPRunner(self.model, self.kv_caches, config.block_size, config.seed, tp_group)
        else:
            self.runner = ModelRunner(self.model, self.kv_caches, config.block_size, config.seed)
        if graphs:
            from engine.cuda_graph import DecodeGraphs

            self.runner.graphs = DecodeGraphs(self.model, self.kv_caches, config.block_size, self.max_model_len,
                                              config.max_num_seqs, sink_block=num_blocks)
        self.eos_token_ids = frozenset(model_config.eos_token_ids)
        self.grammars: GrammarCompiler | None = None  # set by enable_guided
        self._seqs: dict[str, Sequence] = {}
        # guided sequences waiting for their grammar to compile: id -> (seq, future, admitted prefilled)
        self._compiling: dict[str, tuple[Sequence, Future, bool]] = {}
        self.num_steps = 0
        self.num_prompt_tokens_computed = 0  # prompt positions run through the model (a recompute counts again)
        if tp_group is not None:
            tp_group.finish_start(num_blocks, self.kv_caches)

    def close(self) -> None:
        """Stop the other tensor-parallel ranks, if any (idempotent)."""
        if self.tp_group is not None:
            self.tp_group.close()
        if self.grammars is not None:
            self.grammars.close()

    def enable_guided(self, hf_tokenizer) -> None:
        """Take guided requests (engine.guided), with the checkpoint's tokenizer; call once
        ``eos_token_ids`` is complete (a finished grammar allows only those)."""
        self.grammars = GrammarCompiler(hf_tokenizer, self.model_config.vocab_size, self.eos_token_ids)

    def prepare_grammar(self, params: SamplingParams) -> Future | None:
        """Start compiling ``params.guided`` off this thread (cached by spec); None when unguided.
        A decode replica calls it on a reservation, so the grammar compiles while the KV comes."""
        if params.guided is None:
            return None
        if self.grammars is None:
            raise ValueError("guided: this replica has no tokenizer to build a grammar's vocabulary from")
        return self.grammars.compile(params.guided)

    # ---- requests ------------------------------------------------------
    def check_prompt(self, prompt_token_ids: list[int], max_tokens: int = 1) -> None:
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("prompt: must not be empty")
        if n >= self.max_model_len:
            raise ValueError(
                f"prompt: {n} tokens does not fit the context of {self.max_model_len} tokens")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise ValueError(f"prompt_token_ids: {bad[0]} is outside the vocabulary (size {self.model_config.vocab_size})")
        need = -(-min(n + max_tokens, self.max_model_len) // self.config.block_size)
        if need > self.pool.num_blocks:
            raise ValueError(
                f"prompt: {n} tokens + max_tokens {max_tokens} needs {need} KV blocks; "
                f"the cache has {self.pool.num_blocks}")

    def add(self, seq: Sequence) -> None:
        if seq.request_id in self._seqs:
            raise ValueError(f"request_id: {seq.request_id!r} is already running")
        # a resumed sequence computes its output so far with the prompt
        self.check_prompt(seq.token_ids, 1 if seq.prefill_only else seq.params.max_tokens - seq.num_output_tokens)
        grammar = self.prepare_grammar(seq.params)
        if not seq.eos_token_ids:
            seq.eos_token_ids = self.eos_token_ids
        self._seqs[seq.request_id] = seq
        if grammar is None:
            self.scheduler.add(seq)
        else:  # scheduled once its grammar compiled; other requests step meanwhile
            self._compiling[seq.request_id] = (seq, grammar, False)

    def admit_prefilled(self, seq: Sequence, block_ids: list[int], first_token: int) -> bool:
        """Admit a sequence whose prompt KV (and that of any output it resumes
        after) another replica computed into ``block_ids`` (taken from this
        pool), with the token it sampled there, already sent to the client:
        the sequence runs from the token after it. Returns whether the first token already ended it (stop
        token, EOS, max_tokens); then its blocks are freed and it never runs. A guided sequence runs
        once its grammar compiled, its state rebuilt from the output tokens so far."""
        grammar = self.prepare_grammar(seq.params)
        seq.block_ids = list(block_ids)
        seq.num_computed_tokens = seq.num_tokens  # the prompt and any output it resumed after
        seq.output_token_ids.append(first_token)
        seq.metrics.first_token_time = seq.metrics.kv_ready_time = time.monotonic()
        if not seq.eos_token_ids:
            seq.eos_token_ids = self.eos_token_ids
        self._seqs[seq.request_id] = seq
        self.kv.cache_full_blocks(seq)
        stop = self.scheduler.check_stop(seq, first_token)
        if stop is not None:
            self.finish(seq, stop)
        elif grammar is None:
            self.scheduler.add_running(seq)
        else:
            self._compiling[seq.request_id] = (seq, grammar, True)
        return seq.is_finished

    def free_prefilled(self, seq: Sequence) -> None:
        """Free a prefill-only sequence's blocks once its KV has been sent
        (the full ones stay in the prefix cache)."""
        self.kv.free(seq)

    def free_blocks(self, block_ids: list[int]) -> None:
        """Give back blocks taken from this pool outside a sequence (a reservation)."""
        self.pool.free(block_ids)

    def abort(self, request_id: str, status: SequenceStatus = SequenceStatus.FINISHED_ABORTED,
              error: str | None = None) -> Sequence | None:
        seq = self._seqs.pop(request_id, None)
        self._compiling.pop(request_id, None)
        if seq is not None:
            self.scheduler.finish(seq, status, error)
        return seq

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        self.scheduler.finish(seq, status)
        self._seqs.pop(seq.request_id, None)
        self._compiling.pop(seq.request_id, None)

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0 or bool(self._compiling) or bool(self._in_flight)

    def get(self, request_id: str) -> Sequence | None:
        return self._seqs.get(request_id)

    def is_idle(self) -> bool:
        """No sequence left and every block free: what a replica is after its requests ended."""
        return self.pool.is_fully_free() and not self.has_unfinished()

    def cached_block_hashes(self) -> frozenset[int]:
        return frozenset(self.pool.cached_hashes())

    def load(self, replica_id: str, is_alive: bool = True, num_sending: int = 0, num_incoming: int = 0,
             num_kv_bytes_sent: int = 0) -> LoadReport:
        """What a replica reports to the router (and, for the metrics, what it computed and sent since start)."""
        return LoadReport(replica_id, is_alive, self.scheduler.num_queued_prefill_tokens(),
                          len(self.scheduler.running), len(self.scheduler.waiting) + len(self._compiling),
                          self.pool.num_free_blocks,
                          self.pool.num_blocks, num_sending, num_incoming,
                          expert_load=tuple(self.expert_load().sum(0).tolist()) if self.model_config.is_moe else (),
                          num_prompt_tokens_computed=self.num_prompt_tokens_computed,
                          num_kv_bytes_sent=num_kv_bytes_sent)

    def expert_load(self) -> torch.Tensor:
        """A mixture of experts: tokens routed to each expert since start, [sparse layers, experts]
        (rows in ModelConfig.moe_layers order), each (token, expert) pair once. Under the `allreduce`
        dispatch rank 0 routes every token itself; under `alltoall` each rank routes its slice and
        rank 0 adds the counts the ranks exchange before the dispatch (engine.parallel.moe). With
        expert parallelism, a rank's load is the sum over the experts it holds (`expert_ranks`). With pipeline parallelism each stage's leader counts its own layers' rows in
        the shared segment (engine.parallel.pipe.StageChannel.share_expert_counts)."""
        return self.model.expert_counts.clone()

    # ---- the loop ------------------------------------------------------
    def step(self, on_batch: Callable[[SchedulerOutput], LayerHook | None] | None = None) -> list[StepOutput]:
        """One schedule → execute → update round. ``on_batch`` sees the scheduled
        batch before the forward pass and may return a per-layer hook (the
        prefill stage starts KV sends there).

        With pipeline_parallel_size > 1 see `_step_pipelined`: a round may launch a batch and apply
        an earlier one's tokens (or, filling the pipeline, return nothing). The hook then gets global
        layer ids, each once per batch and in order: rank 0's own layers during its forward (at
        launch), and each later stage's layers when rank 0 sees that stage's done counter reach the
        batch (engine.parallel.pipe), while it waits for the batch's logits: a range's KV is written
        on its rank by then, and leaves as soon as rank 0 is back from launching the next batch."""
        if self.pp_size > 1:
            return self._step_pipelined(on_batch)
        failed = self._start_compiled() if self._compiling else []
        with phase(SCHEDULE):
            sched = self.scheduler.schedule()
        if sched.is_empty:
            if self._compiling and not failed:  # only grammars to wait for: give their thread the GIL
                wait([f for _, f, _ in self._compiling.values()], timeout=0.002, return_when=FIRST_COMPLETED)
            return failed
        layer_hook = on_batch(sched) if on_batch is not None else None
        sampled = self.runner.execute(sched.scheduled, layer_hook)
        self.num_steps += 1
        return self._update(sched, sampled, failed)

    def _update(self, sched: SchedulerOutput, sampled: dict, outputs: list[StepOutput]) -> list[StepOutput]:
        self.num_prompt_tokens_computed += sum(max(0, min(s.start + s.num_new_tokens, s.seq.num_prompt_tokens) - s.start)
                                               for s in sched.scheduled)
        now = time.monotonic()
        with phase(UPDATE):
            for seq in self.scheduler.update(sched, sampled):
                m = seq.metrics
                if m.first_token_time is None:
                    m.first_token_time = now
                elif m.first_decode_time is None:
                    m.first_decode_time = now
                if seq.is_finished:
                    self._seqs.pop(seq.request_id, None)
                outputs.append(StepOutput(seq, [seq.output_token_ids[-1]]))
        return outputs

    def _step_pipelined(self, on_batch) -> list[StepOutput]:
        """One round with up to pipeline_parallel_size batches in flight (as vLLM's batch queue): launch
        the next batch while the earlier ones are on later stages, and apply the oldest one's sampled
        tokens once the pipeline is full or nothing more can be scheduled. A sequence whose batch
        samples is not scheduled again until that batch is back (a decode is never in two batches);
        a prompt's non-final chunk samples nothing, so its next chunk may follow it in at once. Each
        batch takes at most 1/pp of the sequences, so that decodes fill every stage."""
        failed = self._start_compiled() if self._compiling else []
        launched = False
        if len(self._in_flight) < self.pp_size:
            with phase(SCHEDULE):
                share = -(-self.scheduler.num_unfinished // self.pp_size)
                sched = self.scheduler.schedule(self._busy, max(1, share))
            if not sched.is_empty:
                layer_hook = on_batch(sched) if on_batch is not None else None
                batch = self.runner.launch(sched.scheduled, layer_hook)
                for s in sched.scheduled:
                    if s.samples:
                        self._busy.add(s.seq.request_id)
                    else:  # the next chunk may be scheduled behind this one
                        s.seq.num_computed_tokens = s.start + s.num_new_tokens
                self._in_flight.append(InFlightBatch(sched, batch, [s.seq.metrics.num_preemptions
                                                                    for s in sched.scheduled]))
                self.num_steps += 1
                launched = True
        if not self._in_flight:
            if self._compiling and not failed:  # only grammars to wait for: give their thread the GIL
                wait([f for _, f, _ in self._compiling.values()], timeout=0.002, return_when=FIRST_COMPLETED)
            return failed
        if launched and len(self._in_flight) < self.pp_size:
            return failed  # room for one more batch first
        done = self._in_flight.popleft()
        sampled = self.runner.collect(done.handle)
        for s in done.handle.samplers:
            self._busy.discard(s.seq.request_id)
        # a sequence preempted while its batch was in the pipeline starts over: drop what came back
        kept = [s for s, m in zip(done.sched.scheduled, done.preemptions) if s.seq.metrics.num_preemptions == m]
        return self._update(SchedulerOutput(kept), sampled, failed)

    def _start_compiled(self) -> list[StepOutput]:
        """Sequences whose grammar compiled join the scheduler, the state rebuilt
        from their output so far; those whose grammar failed end with the error."""
        failed = []
        for rid, (seq, grammar, prefilled) in list(self._compiling.items()):
            if not grammar.done():
                continue
            del self._compiling[rid]
            try:
                seq.grammar = GrammarState(grammar.result(), seq.output_token_ids)
            except Exception as e:  # GuidedError names the problem
                self.scheduler.finish(seq, SequenceStatus.FINISHED_ERROR, str(e))
                self._seqs.pop(rid, None)
                failed.append(StepOutput(seq, []))
                continue
            if prefilled:
                self.scheduler.add_running(seq)
            else:
                self.scheduler.add(seq)
        return failed
