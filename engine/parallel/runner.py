"""Rank 0's model runner in a tensor-parallel group: each step, the other ranks get the
batch as ids and diffs (engine.parallel.step), then every rank runs its shard of the
forward and rank 0 alone samples, on the logits gathered to it."""
from __future__ import annotations

from engine.model import LayerHook
from engine.parallel.comm import CollectiveError
from engine.parallel.group import TPGroup
from engine.parallel.step import StepEncoder
from engine.runner import ModelRunner
from engine.scheduler import ScheduledSeq


class TPRunner(ModelRunner):
    def __init__(self, model, kv_caches, block_size: int, seed: int, group: TPGroup):
        super().__init__(model, kv_caches, block_size, seed)
        self.group = group
        self.encoder = StepEncoder()

    def execute(self, batch: list[ScheduledSeq], layer_hook: LayerHook | None = None):
        self.group.check()
        self.group.finish_peer_writes()  # CUDA: KV received into other ranks' caches is complete before they read it
        try:
            self.group.send_step(self.encoder.encode(batch))
            return super().execute(batch, layer_hook)
        except BaseException as e:
            cause = self.group.worker_error() or self.group.gone_ranks()
            self.group.fail()
            if cause is not None:
                raise CollectiveError(f"tensor-parallel step failed: {cause}") from e
            raise
