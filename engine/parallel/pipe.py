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
   `[n, vocab]` float32 (n may be 0: a batch of non-final prefill chunks), then the
   results of the prompt positions the batch scores (engine.runner.score_rows), into the
   return slot; RET_SEQ = k; rank 0 copies them out and raises RET_ACK.

Every wait is `ShmGroup.wait_flag`: bounded by tp_timeout_s, the group's abort flag and the
peers' liveness, so a dead or stuck stage fails the others' step instead of hanging them.

With tp_backend gloo (CPU) or nccl (CUDA) only the payloads move (`DistLinks`): the hidden
states and the logits rows go rank to rank over torch.distributed point-to-point, on the
replica's process group, and stay on the device; the flags above stay in the segment as they
are, so the control plane (step messages, DONE for the layer hook, liveness, abort) and every
bound are the shm path's. A sender posts its send before it raises the flag, so a receiver
posts its receive only once the data is on its way: the one wait that is not a flag's (the
receive's own) is short, and bounded besides: by what is left of tp_timeout_s since the wait
for the flag began (gloo: the wait's own timeout, since it has none by default; NCCL: polled
under the flag's bounds, abort and liveness too). The row counts need no message: every rank
decodes the step message (T tokens, n sampled rows).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from datetime import timedelta

import torch

from engine.parallel.comm import CollectiveError
from engine.parallel.shm import SegmentLayout, ShmGroup


@dataclass
class PipeStats:
    """What this rank handed to the next stage (engine.parallel.pp_bench reads it)."""

    num_sends: int = 0
    bytes_sent: int = 0
    tokens_sent: int = 0


def pipe_pairs(layout: SegmentLayout) -> list[tuple[int, int]]:
    """Every (sender, receiver) of the hand-offs, in one order: stage s's leader to each rank of
    stage s + 1, boundary by boundary, then the last stage's leader to rank 0."""
    tp, pp = layout.tp, layout.pp
    return [(b * tp, (b + 1) * tp + t) for b in range(pp - 1) for t in range(tp)] + [((pp - 1) * tp, 0)]


class DistLinks:
    """The hand-offs' payloads over torch.distributed point-to-point (tp_backend gloo or nccl).

    Each (sender, receiver) pair of `pipe_pairs` is a link: a two-rank group of its own, used in
    one direction only, so each pair is one ordered stream (NCCL matches a pair's operations by
    order, gloo by tag: the tag is the batch number). A group each keeps the directions apart:
    on one NCCL stream rank 0's send of batch k + 1 to stage 1 would queue ahead of its receive
    of batch k's logits, which the last stage sends before it takes batch k + 1: a cycle. Every
    rank makes every group, in the same order, and each link carries one warm-up message at
    start (in that order, so no two ranks wait on each other): NCCL builds a pair's communicator
    at its first operation, which must not be a step's. ``dist`` is this rank's
    engine.parallel.comm collectives (made with ``tp``, before this); received tensors are
    allocated on ``device``.

    Why stage s's leader sends to every rank of stage s + 1, not to its leader alone for a
    broadcast inside the stage: one hop, no collective on the receiving side (each rank's
    receive is its own, bounded like a flag wait), and every rank of the stage gets the same
    bits, as from the shared slot. It costs the leader tp sends of [T, hidden], small beside a
    stage's all-reduces (engine.parallel.pp_bench)."""

    def __init__(self, dist, layout: SegmentLayout, device: str):
        self._dist, self.backend = dist._dist, dist.backend
        self.rank, self.device, self.timeout_s = dist.world_rank, device, dist.timeout_s
        self.is_cuda = device.startswith("cuda")
        self._groups = {}
        pairs = pipe_pairs(layout)
        for pair in pairs:  # (a collective over the world: every rank, every group, this order)
            group = self._dist.new_group(list(pair))
            if self.rank in pair:
                self._groups[pair] = group
        self._sends: dict[int, deque] = {}  # receiver -> (batch, work, tensor) not yet known received
        for src, dst in pairs:  # the warm-up, each message waited for before the next
            if self.rank == src:
                work = self._dist.isend(torch.zeros(1, device=device), dst, group=self._groups[src, dst])
            elif self.rank == dst:
                work = self._dist.irecv(torch.empty(1, device=device), src, group=self._groups[src, dst])
            else:
                continue
            self._finish(work, f"pipeline link {src} -> {dst} at start ({self.backend})")
        if self.is_cuda:
            torch.cuda.synchronize(device)

    def send(self, k: int, dst: int, x: torch.Tensor) -> None:
        """Post batch k's ``x`` to ``dst`` (contiguous; held until `reap` says it was received)."""
        x = x.contiguous()
        work = self._dist.isend(x, dst, group=self._groups[self.rank, dst], tag=k & 0x3FFFFFFF)
        self._sends.setdefault(dst, deque()).append((k, work, x))

    def reap(self, dst: int, k: int) -> None:
        """``dst`` received every batch up to k (its acknowledgement flag says so): finish those sends."""
        sends = self._sends.get(dst)
        while sends and sends[0][0] <= k:
            _, work, _ = sends.popleft()
            self._finish(work, f"pipeline send to rank {dst} ({self.backend})")

    def recv(self, k: int, src: int, shape: tuple[int, ...], dtype: torch.dtype, shm: ShmGroup, what: str,
             since: float) -> torch.Tensor:
        """Batch k's tensor from ``src`` (its send is posted: the flag is up), on this rank's device;
        the wait for it began at ``since`` (time.monotonic) and ends, with the transfer, within tp_timeout_s."""
        out = torch.empty(shape, dtype=dtype, device=self.device)
        work = self._dist.irecv(out, src, group=self._groups[src, self.rank], tag=k & 0x3FFFFFFF)
        self._finish(work, f"{what} ({self.backend})", shm, since)
        return out

    def _finish(self, work, what: str, shm: ShmGroup | None = None, since: float | None = None) -> None:
        t0 = time.monotonic()
        budget = max(self.timeout_s - (t0 - (since or t0)), 1e-3)
        try:
            if not self.is_cuda:  # (a gloo work reports completion only from wait(), which waits unbounded)
                work.wait(timeout=timedelta(seconds=budget))
                return
            if shm is not None:
                shm.wait_until(work.is_completed, what, budget)
            work.wait()  # orders this rank's stream after the transfer
        except RuntimeError as e:
            if isinstance(e, CollectiveError):
                raise
            waited = time.monotonic() - (since or t0)
            if time.monotonic() - t0 >= budget:
                raise CollectiveError(f"tensor-parallel {what}: rank {self.rank} waited {waited:.1f} s "
                                      f"(timeout {self.timeout_s:g} s) for a peer") from e
            raise CollectiveError(f"tensor-parallel {what} failed on rank {self.rank}: {e}") from e


class StageChannel:
    """One rank's end of the hand-offs: ``rank`` its segment rank; ``links`` the payloads'
    torch.distributed links (tp_backend gloo or nccl), None: they go through the segment."""

    def __init__(self, shm: ShmGroup, rank: int, links: DistLinks | None = None):
        self.shm, lay = shm, shm.layout
        self.layout = lay
        self.links = links
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
                if self.links is not None:
                    self.links.reap((b + 1) * lay.tp + t, k - lay.pipe_slots)
        nbytes = x.numel() * x.element_size()
        if self.links is not None:
            for t in range(lay.tp):
                self.links.send(k, (b + 1) * lay.tp + t, x)
        else:
            if nbytes > lay.act_bytes:
                raise RuntimeError(f"pipeline hand-off of {nbytes} bytes exceeds the slot's {lay.act_bytes}")
            self.shm.region(lay.act_offset(b, slot), x.dtype, x.numel()).copy_(x.reshape(-1))
        self.shm.set_flag(lay.act_seq(b), k)
        self.stats.num_sends += 1
        self.stats.bytes_sent += nbytes * (lay.tp if self.links is not None else 1)  # (a copy to each reader)
        self.stats.tokens_sent += x.shape[0]

    def recv_hidden(self, k: int, num_tokens: int, hidden_size: int, dtype: torch.dtype) -> torch.Tensor:
        """Batch k's residual stream from the previous stage: [num_tokens, hidden_size]."""
        lay, b, slot = self.layout, self.stage - 1, k % self.layout.pipe_slots
        what, since = f"pipeline hand-off from stage {b} (rank {b * lay.tp})", time.monotonic()
        self.shm.wait_flag(lay.act_seq(b), k, what)
        if self.links is not None:
            x = self.links.recv(k, b * lay.tp, (num_tokens, hidden_size), dtype, self.shm, what, since)
        else:
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
        if self.links is not None and self.links.is_cuda:  # written on the GPU, not only queued: rank 0's
            torch.cuda.current_stream().synchronize()      # layer hook reads this KV from another process
        self.shm.set_flag(self.layout.stage_done(self.stage), k)

    def send_logits(self, k: int, logits: torch.Tensor | None) -> None:
        """The last stage's leader: what batch k returns, float32 (its sampled rows' logits, or their
        tokens, then its scored prompt positions: engine.parallel.worker._run_stage); None: nothing."""
        lay, slot = self.layout, k % self.layout.pipe_slots
        if k > lay.pipe_slots:
            self.shm.wait_flag(lay.ret_ack, k - lay.pipe_slots, "pipeline logits return (to rank 0)")
            if self.links is not None:
                self.links.reap(0, k - lay.pipe_slots)
        if logits is not None and self.links is not None:
            self.links.send(k, 0, logits.float().reshape(-1))
        elif logits is not None:
            nbytes = logits.numel() * 4
            if nbytes > lay.ret_bytes:
                raise RuntimeError(f"pipeline logits of {nbytes} bytes exceed the return slot's {lay.ret_bytes}")
            self.shm.region(lay.ret_offset(slot), torch.float32, logits.numel()).copy_(logits.reshape(-1))
        self.shm.set_flag(lay.ret_seq, k)

    def recv_logits(self, k: int, numel: int, on_stage_done=None) -> torch.Tensor:
        """Rank 0: the ``numel`` float32 numbers batch k returns from the last stage (`send_logits`),
        flat. With ``on_stage_done``, it is called with each later stage (1, 2, ...) as that stage
        finishes batch k's layers, before the return comes."""
        lay, slot = self.layout, k % self.layout.pipe_slots
        # (with links also without a hook: a stuck sender can hold its receiver in the transfer past this
        # rank's own wait, so this rank names the first stage that has not finished the batch)
        if on_stage_done is not None or self.links is not None:
            for s in range(1, lay.pp):
                self.shm.wait_flag(lay.stage_done(s), k, f"pipeline stage {s} (rank {s * lay.tp})")
                if on_stage_done is not None:
                    on_stage_done(s)
        what, since = f"pipeline logits return (from rank {(lay.pp - 1) * lay.tp})", time.monotonic()
        self.shm.wait_flag(lay.ret_seq, k, what)
        if self.links is None:
            out = self.shm.region(lay.ret_offset(slot), torch.float32, numel).clone()
        elif numel:
            out = self.links.recv(k, (lay.pp - 1) * lay.tp, (numel,), torch.float32, self.shm, what, since)
        else:  # (nothing to return: nothing was sent)
            out = torch.empty(0, dtype=torch.float32, device=self.links.device)
        self.shm.set_flag(lay.ret_ack, k)
        return out
