"""Rank 0's model runner in a tensor-parallel group: each step, the other ranks get the
batch as ids and diffs (engine.parallel.step), then every rank runs its shard of the
forward and rank 0 alone samples, on the logits gathered to it.

With pipeline parallelism (`PPRunner`) a step is split in two so that several batches
can be in the pipeline at once (engine.core keeps up to pipeline_parallel_size of them):
`launch` sends the step message, runs stage 0's layers and hands the hidden states on;
`collect` waits for that batch's logits rows from the last stage (firing the layer hook
for each later stage's layers as that stage finishes them) and samples on rank 0.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.model import LayerHook
from engine.parallel.comm import CollectiveError
from engine.parallel.group import TPGroup
from engine.parallel.step import StepEncoder, is_plain_greedy
from engine.profiling import FORWARD, SAMPLE, phase
from engine.runner import ModelRunner, PromptScores, plan_scores
from engine.scheduler import ScheduledSeq


class TPRunner(ModelRunner):
    kind = "tensor-parallel"

    def __init__(self, model, kv_caches, block_size: int, seed: int, group: TPGroup):
        super().__init__(model, kv_caches, block_size, seed)
        self.group = group
        self.encoder = StepEncoder()

    def execute(self, batch: list[ScheduledSeq], layer_hook: LayerHook | None = None):
        self.group.check()
        self.group.finish_peer_writes()  # CUDA: KV received into other ranks' caches is complete before they read it
        try:
            scores = plan_scores(batch)
            self.group.send_step(self.encoder.encode(batch, scores))
            return self.run(batch, scores, layer_hook)
        except BaseException as e:
            self._fail(e)

    def _fail(self, e: BaseException):
        """A step failed part-way: tear the group down and raise, naming the rank that caused it."""
        cause = self.group.worker_error() or self.group.gone_ranks() or self.group.worker_error(wait_s=1.0)
        self.group.fail()
        if cause is not None:
            raise CollectiveError(f"{self.kind} step failed: {cause}") from e
        raise e


@dataclass
class InFlight:
    """A batch in the pipeline: its step number (engine.parallel.pipe's k) and what sampling needs."""

    index: int
    samplers: list[ScheduledSeq]
    layer_hook: LayerHook | None
    argmax: bool = False  # every sampler plain greedy: the last stage returns tokens (engine.parallel.step)
    scores: PromptScores | None = None  # the prompt positions the last stage scores


class PPRunner(TPRunner):
    kind = "pipeline-parallel"

    def __init__(self, model, kv_caches, block_size: int, seed: int, group: TPGroup):
        super().__init__(model, kv_caches, block_size, seed, group)
        self.pipe = group.pipe
        ranks = group.rank_layers()
        self.stage_layers = ranks[::group.tp_size]  # stage -> its global layers
        self.num_batches = 0

    def execute(self, batch: list[ScheduledSeq], layer_hook: LayerHook | None = None):
        return self.collect(self.launch(batch, layer_hook))

    def launch(self, batch: list[ScheduledSeq], layer_hook: LayerHook | None = None) -> InFlight:
        """Start `batch` down the pipeline; its results come from `collect`, batches in launch order."""
        self.group.check()
        try:
            scores = plan_scores(batch)
            self.group.send_step(self.encoder.encode(batch, scores))
            self.num_batches += 1
            with phase(FORWARD):
                input_ids, positions, meta, _ = self.prepare(batch)
                hidden = self.model.forward(input_ids, positions, meta, self.kv_caches, layer_hook)
                self.pipe.send_hidden(self.num_batches, hidden)
        except BaseException as e:
            self._fail(e)
        samplers = [s for s in batch if s.samples]
        return InFlight(self.num_batches, samplers, layer_hook, all(is_plain_greedy(s.seq) for s in samplers), scores)

    def collect(self, batch: InFlight) -> dict[str, tuple[int, dict | None]]:
        """Wait for `batch` to leave the last stage; {request_id: (token, logprobs)} of its samplers."""
        hook = batch.layer_hook
        on_stage_done = None if hook is None else lambda s: [hook(i) for i in self.stage_layers[s]]
        try:
            with phase(FORWARD):
                width = 1 if batch.argmax else self.model.cfg.vocab_size  # tokens, or logits rows
                n = len(batch.samplers) * width
                scored = 0 if batch.scores is None else len(batch.scores.rows) * batch.scores.width
                back = self.pipe.recv_logits(batch.index, n + scored, on_stage_done)
        except BaseException as e:
            self._fail(e)
        logits = back[:n].view(len(batch.samplers), width)
        if scored:
            batch.scores.apply(back[n:])
        if not batch.samplers:
            return {}
        if batch.argmax:  # the last stage took the argmax (engine.parallel.worker._run_stage)
            tokens = logits.view(torch.int32).view(-1).tolist()
            return {s.seq.request_id: (t, None) for s, t in zip(batch.samplers, tokens)}
        with phase(SAMPLE):
            return self.sample(batch.samplers, logits)
