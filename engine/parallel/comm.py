"""The collectives a sharded model calls, injected into it (engine.model.LlamaModel's ``comm``).

A model sees only `Collectives`: ``all_reduce`` (sum across the ranks, the
result on every rank), ``gather_vocab`` (the vocab-parallel logits,
concatenated along the vocabulary on the rank that samples), and the two
exchanges of the ``alltoall`` expert dispatch (engine.parallel.moe):
``all_to_all`` (rows to the ranks that need them, split sizes given) and
``all_gather`` (each rank's rows, uneven counts, concatenated on every rank). `SINGLE` is the
TP=1 no-op. The implementations live beside this module and are chosen by
name: ``shm`` (engine.parallel.shm, ranks on one host), ``gloo``
(torch.distributed over TCP) and ``nccl`` (torch.distributed on CUDA, a GPU per
rank); imported lazily, so the model imports no
torch.distributed.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol

import torch


class CollectiveError(RuntimeError):
    """A collective could not complete: a rank died, failed, or did not arrive in time."""


@dataclass
class CollectiveStats:
    """What this rank spent in collectives (engine.parallel.bench reads it). Seconds are wall
    time inside the calls: the data movement and the wait for the slowest rank."""

    num_all_reduces: int = 0
    bytes_all_reduced: int = 0  # this rank's tensors, summed
    all_reduce_s: float = 0.0
    gather_s: float = 0.0
    all_to_all_s: float = 0.0  # the all-to-alls and the all-gathers of the alltoall expert dispatch

    def add(self, nbytes: int, seconds: float) -> None:
        self.num_all_reduces += 1
        self.bytes_all_reduced += nbytes
        self.all_reduce_s += seconds


class Collectives(Protocol):
    rank: int
    size: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the ranks (contiguous; may be reduced in place and returned).
        Every rank gets the same bits."""

    def gather_vocab(self, x: torch.Tensor) -> torch.Tensor | None:
        """x: [N, vocab_shard] -> [N, size * vocab_shard] (rank order) on rank 0, None elsewhere."""

    def all_to_all(self, x: torch.Tensor, splits: list[list[int]]) -> torch.Tensor:
        """Rows to ranks: ``splits[s][d]`` is how many rows rank s sends rank d (the whole matrix,
        the same on every rank). x: [sum(splits[rank]), ...], its rows grouped by destination in
        rank order -> [sum of column ``rank``, ...], what each source sent, in rank order."""

    def all_gather(self, x: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """x: [rows[rank], ...] -> [sum(rows), ...], every rank's rows in rank order, on every rank."""


def row_splits(num_rows: int, size: int) -> list[int]:
    """Contiguous, as even as they go: the first ``num_rows % size`` ranks take one row more."""
    base, extra = divmod(num_rows, size)
    return [base + (r < extra) for r in range(size)]


class _Single:
    rank, size = 0, 1

    @staticmethod
    def all_reduce(x: torch.Tensor) -> torch.Tensor:
        return x

    @staticmethod
    def gather_vocab(x: torch.Tensor) -> torch.Tensor:
        return x


SINGLE: Collectives = _Single()


class _DistCollectives:
    """torch.distributed collectives over one process group; a subclass names the backend and
    how a tensor is summed (`_sum`).

    ``size`` ranks in all; with pipeline parallelism (``tp`` < ``size``) they form stages of
    ``tp`` consecutive ranks and a model's collectives run within its stage's group (every rank
    makes every stage's group, in stage order, as torch.distributed requires): ``self.rank`` and
    ``self.size`` are then the place in the stage and its size, as a model sees them, and
    ``world_rank`` the rank in the whole replica (engine.parallel.pipe's links use it)."""

    backend = ""

    def __init__(self, rank: int, size: int, init_method: str, timeout_s: float, tp: int | None = None,
                 **init_kwargs):
        import torch.distributed as dist

        tp = tp or size
        self.world_rank, self.world_size, self._dist = rank, size, dist
        self.rank, self.size = rank % tp, tp
        self.timeout_s = timeout_s
        self.stats = CollectiveStats()
        dist.init_process_group(self.backend, init_method=init_method, rank=rank, world_size=size,
                                timeout=timedelta(seconds=timeout_s), **init_kwargs)
        self.group = None  # None: the whole world (at tp 1 with stages, a model's comm is SINGLE instead)
        if 1 < tp < size:
            stages = [dist.new_group(list(range(s * tp, (s + 1) * tp))) for s in range(size // tp)]
            self.group = stages[rank // tp]

    def _sum(self, x: torch.Tensor) -> None:
        self._dist.all_reduce(x, group=self.group)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        try:
            self._sum(x)
        except RuntimeError as e:
            raise CollectiveError(f"tensor-parallel all-reduce ({self.backend}) failed on rank {self.world_rank}: "
                                  f"{e}") from e
        self.stats.add(x.numel() * x.element_size(), time.perf_counter() - t0)
        return x

    def gather_vocab(self, x: torch.Tensor) -> torch.Tensor | None:
        t0 = time.perf_counter()
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        try:
            self._dist.gather(x, parts, group=self.group, group_dst=0)
        except RuntimeError as e:
            raise CollectiveError(f"tensor-parallel gather ({self.backend}) failed on rank {self.world_rank}: "
                                  f"{e}") from e
        self.stats.gather_s += time.perf_counter() - t0
        return torch.cat(parts, dim=1) if parts is not None else None

    def all_to_all(self, x: torch.Tensor, splits: list[list[int]]) -> torch.Tensor:
        t0 = time.perf_counter()
        recv = [splits[s][self.rank] for s in range(self.size)]
        out = x.new_empty((sum(recv), *x.shape[1:]))
        try:
            self._dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv,
                                         input_split_sizes=list(splits[self.rank]), group=self.group)
        except RuntimeError as e:
            raise CollectiveError(f"tensor-parallel all-to-all ({self.backend}) failed on rank {self.world_rank}: "
                                  f"{e}") from e
        self.stats.all_to_all_s += time.perf_counter() - t0
        return out

    def all_gather(self, x: torch.Tensor, rows: list[int]) -> torch.Tensor:
        # torch.distributed gathers equal sizes: pad each rank's rows to the most any rank has
        t0 = time.perf_counter()
        most = max(rows)
        padded = x.new_zeros((most, *x.shape[1:]))
        padded[: x.shape[0]] = x
        out = x.new_empty((self.size * most, *x.shape[1:]))
        try:
            self._dist.all_gather_single(out, padded, group=self.group)
        except RuntimeError as e:
            raise CollectiveError(f"tensor-parallel all-gather ({self.backend}) failed on rank {self.world_rank}: "
                                  f"{e}") from e
        self.stats.all_to_all_s += time.perf_counter() - t0
        if all(n == most for n in rows):
            return out
        return torch.cat([out[r * most: r * most + n] for r, n in enumerate(rows)])

    def close(self) -> None:
        if self._dist.is_initialized():
            self._dist.destroy_process_group()


class GlooCollectives(_DistCollectives):
    """torch.distributed with the gloo backend (CPU tensors, over TCP even on one host:
    each all-reduce costs round trips between the processes; engine.parallel.bench measures it).
    bf16 is summed in fp32, as the shared-memory path does."""

    backend = "gloo"

    def _sum(self, x: torch.Tensor) -> None:
        if x.dtype == torch.float32:
            self._dist.all_reduce(x, group=self.group)
        else:
            acc = x.float()
            self._dist.all_reduce(acc, group=self.group)
            x.copy_(acc)


class NcclCollectives(_DistCollectives):
    """torch.distributed with the NCCL backend: CUDA tensors, each rank on its own GPU
    (``device``, engine.parallel.devices), bound at init so the communicator is built eagerly.
    NCCL sums bf16/fp16 natively and every rank gets the same bits. Collectives time out after
    ``timeout_s`` (torch's NCCL watchdog aborts the communicator), so no rank waits forever."""

    backend = "nccl"

    def __init__(self, rank: int, size: int, init_method: str, timeout_s: float, device: str,
                 tp: int | None = None):
        torch.cuda.set_device(device)
        super().__init__(rank, size, init_method, timeout_s, tp, device_id=torch.device(device))


def dist_collectives(backend: str, rank: int, size: int, init_method: str, timeout_s: float,
                     device: str, tp: int | None = None) -> _DistCollectives:
    """The torch.distributed collectives of ``backend`` ("gloo" or "nccl") for this rank of
    ``size``, within its stage of ``tp`` ranks (default: all of them)."""
    if backend == "nccl":
        return NcclCollectives(rank, size, init_method, timeout_s, device, tp)
    if backend == "gloo":
        return GlooCollectives(rank, size, init_method, timeout_s, tp)
    raise ValueError(f"no torch.distributed collectives for tp_backend {backend!r}")
