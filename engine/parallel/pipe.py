"""The hand-offs between pipeline stages, in the ranks' shared segment (engine.parallel.shm).

Ranks are numbered rank = pp_rank * tp + tp_rank; rank 0 (stage 0, TP rank 0) owns the
scheduler, the block pool and sampling. Every rank reads every step message, in order,
and counts them: batch k is the k-th step message, the same k on every rank. Per batch:

1. stage 0 runs its layers; its first rank (the stage's leader) writes the residual stream
   `[T, hidden]` into boundary 0's slot ``k % pipe_slots`` and raises ACT_SEQ[0] to k;
2. every rank of stage s > 0 waits for ACT_SEQ[s-1] >= k, copies the slot out, raises its
   ACT_ACK[s-1][tp_rank] to k, runs its layers (all-reducing inside its own group) and,
   as leader, hands on to the next boundary (which waits first until every reader of
   that slot's previous batch, k - pipe_slots, acknowledged it);
3. each stage's leader raises DONE[s] to k once the batch's layers are computed (its KV
   written): rank 0 fires the layer hook of those layers then (`recv_logits`);
4. the last stage gathers its logits rows over its group and its leader writes them,
   `[n, vocab]` float32 (n may be 0: a batch of non-final prefill chunks), into the
   return slot; RET_SEQ = k; rank 0 copies them out and raises RET_ACK.

Every wait is `ShmGroup.wait_flag`: bounded by tp_timeout_s, the group's abort flag and the
peers' liveness, so a dead or stuck stage fails the others' step instead of hanging them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.parallel.shm import ShmGroup


@dataclass
class PipeStats:
    """What this rank handed to the next stage (engine.parallel.pp_bench reads it)."""

    num_sends: int = 0
    bytes_sent: int = 0
    tokens_sent: int = 0


class StageChannel:
    """One rank's end of the hand-offs: ``rank`` its segment rank."""

    def __init__(self, shm: ShmGroup, rank: int):
        self.shm, lay = shm, shm.layout
        self.layout = lay
        self.stage, self.tp_rank = divmod(rank, lay.tp)
        self.is_leader = self.tp_rank == 0
        self.is_first, self.is_last = self.stage == 0, self.stage == lay.pp - 1
        self.stats = PipeStats()

    def send_hidden(self, k: int, x: torch.Tensor) -> None:
        """Batch k's residual stream ([T, hidden]) to the next stage (the leader's call)."""
        lay, b, slot = self.layout, self.stage, k % self.layout.pipe_slots
        if k > lay.pipe_slots:
            for t in range(lay.tp):
                self.shm.wait_flag(lay.act_ack(b, t), k - lay.pipe_slots,
                                   f"pipeline hand-off to stage {b + 1} (rank {(b + 1) * lay.tp + t})")
        nbytes = x.numel() * x.element_size()
        if nbytes > lay.act_bytes:
            raise RuntimeError(f"pipeline hand-off of {nbytes} bytes exceeds the slot's {lay.act_bytes}")
        self.shm.region(lay.act_offset(b, slot), x.dtype, x.numel()).copy_(x.reshape(-1))
        self.shm.set_flag(lay.act_seq(b), k)
        self.stats.num_sends += 1
        self.stats.bytes_sent += nbytes
        self.stats.tokens_sent += x.shape[0]

    def recv_hidden(self, k: int, num_tokens: int, hidden_size: int, dtype: torch.dtype) -> torch.Tensor:
        """Batch k's residual stream from the previous stage: [num_tokens, hidden_size]."""
        lay, b, slot = self.layout, self.stage - 1, k % self.layout.pipe_slots
        self.shm.wait_flag(lay.act_seq(b), k, f"pipeline hand-off from stage {b} (rank {b * lay.tp})")
        x = self.shm.region(lay.act_offset(b, slot), dtype, num_tokens * hidden_size).clone()
        self.shm.set_flag(lay.act_ack(b, self.tp_rank), k)
        return x.view(num_tokens, hidden_size)

    def share_expert_counts(self, model) -> None:
        """A mixture of experts: make `model.expert_counts` ([sparse layers, experts], the rows of
        every stage's layers) one tensor in the segment. Each stage's leader counts its own layers'
        rows there as it routes (the stages' rows are disjoint), so rank 0 reads every layer's load
        (EngineCore.expert_load) without a message. The other TP ranks of a stage keep their own
        copy: they route the same tokens as their leader."""
        lay, counts = self.layout, model.expert_counts
        if not lay.counts_bytes or not self.is_leader:
            return
        assert counts.numel() * 8 == lay.counts_bytes, (counts.shape, lay.counts_bytes)
        model.expert_counts = self.shm.region(lay.counts_offset, torch.int64, counts.numel()).view(counts.shape)

    def mark_done(self, k: int) -> None:
        """This stage computed batch k's layers (its KV is written)."""
        self.shm.set_flag(self.layout.stage_done(self.stage), k)

    def send_logits(self, k: int, logits: torch.Tensor | None) -> None:
        """The last stage's leader: batch k's logits rows ([n, vocab] float32; None: none sampled)."""
        lay, slot = self.layout, k % self.layout.pipe_slots
        if k > lay.pipe_slots:
            self.shm.wait_flag(lay.ret_ack, k - lay.pipe_slots, "pipeline logits return (to rank 0)")
        if logits is not None:
            nbytes = logits.numel() * 4
            if nbytes > lay.ret_bytes:
                raise RuntimeError(f"pipeline logits of {nbytes} bytes exceed the return slot's {lay.ret_bytes}")
            self.shm.region(lay.ret_offset(slot), torch.float32, logits.numel()).copy_(logits.reshape(-1))
        self.shm.set_flag(lay.ret_seq, k)

    def recv_logits(self, k: int, num_rows: int, vocab_size: int, on_stage_done=None) -> torch.Tensor:
        """Rank 0: batch k's logits rows [num_rows, vocab_size] from the last stage. With
        ``on_stage_done``, it is called with each later stage (1, 2, ...) as that stage finishes
        batch k's layers, before the logits come."""
        lay, slot = self.layout, k % self.layout.pipe_slots
        if on_stage_done is not None:
            for s in range(1, lay.pp):
                self.shm.wait_flag(lay.stage_done(s), k, f"pipeline stage {s} (rank {s * lay.tp})")
                on_stage_done(s)
        self.shm.wait_flag(lay.ret_seq, k, f"pipeline logits return (from rank {(lay.pp - 1) * lay.tp})")
        out = self.shm.region(lay.ret_offset(slot), torch.float32, num_rows * vocab_size).clone()
        self.shm.set_flag(lay.ret_ack, k)
        return out.view(num_rows, vocab_size)
