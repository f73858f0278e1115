"""Expert dispatch and combine across a tensor-parallel group, chosen by name
(`EngineConfig.moe_dispatch`, so a prefill stage and a decode stage may differ).
A dispatch runs one sparse layer's MLP: (mlp output, tokens per expert) =
dispatch(block, h, ops), with h, the post-attention hidden states [T, H], the
same on every rank (attention's o_proj all-reduce replicates them).

``allreduce`` (the default; with or without expert parallelism): every rank
routes every token (the router is replicated), runs the experts it holds (or
its columns of every expert) on the tokens routed to them, and returns its
partial sum; one all-reduce of [T, H], the one a dense MLP's down_proj takes
anyway, adds the ranks' partials. Nothing is dispatched: the tokens are
already everywhere. Bytes per sparse layer: the all-reduce's, T x H x
2 (size - 1) / size each way on a ring; compute: every rank routes all T
tokens, and each (token, expert) pair is computed once, on its expert's rank.

``alltoall`` (expert parallelism only): a real token dispatch.
  1. Each rank takes its contiguous slice of the T tokens (`row_splits`; no
     communication, h is replicated) and routes only that slice.
  2. The ranks exchange their slices' per-expert counts (an all-gather of
     [E] each): every rank then knows every split size, and the counts summed
     are the layer's expert load, each (token, expert) pair counted once.
  3. All-to-all: each (token, expert) row goes only to the rank that holds
     the expert; the owners run each of their experts once on every row it got
     (engine.moe.MoEBlock.expert, the same grouped kernels), and a second
     all-to-all sends the outputs back to the slice they came from.
  4. Each rank combines its slice's top-k outputs with the routing weights
     (experts in ascending order, as MoEBlock.forward does; Qwen2-MoE's shared
     expert, which this dispatch keeps whole on every rank, on the slice
     only), and an all-gather re-replicates the [T, H] output for the next
     attention.
  Bytes per sparse layer: about T x top_k x H x (size - 1) / size each way
  twice, plus the all-gather's T x H x (size - 1) / size; routing and the
  shared expert run on T / size tokens per rank instead of T.

When each pays off. The all-to-all moves top_k times the rows of an
all-reduce and takes four exchanges instead of one; its wins are that no rank
routes or runs a shared expert on tokens outside its slice, and that the
bytes scale with the rows actually routed. Across GPUs and hosts with large
batches (prefill) and many experts that is the cheaper side, and with
sequence- or data-parallel attention (activations not replicated) it is the
only one. On CPU ranks of one host (shm, gloo) a collective costs its
synchronisation, not its bytes, and the all-reduce is paid by the layer
anyway, so ``allreduce`` is the faster one there (BENCHMARKS.md, Mixture of
experts); ``alltoall`` runs on shm, gloo and nccl alike, so a stage may pick
either by name.
"""
from __future__ import annotations

import time

import torch

from engine.config import MOE_DISPATCHES as DISPATCHES
from engine.parallel.comm import row_splits


class AllReduceDispatch:
    """The ``allreduce`` dispatch: tokens are already on every rank; the combine is the sum."""

    name = "allreduce"

    def __init__(self, comm):
        self.comm = comm
        self.total_s = 0.0  # wall time in the sparse MLPs (engine/moe_bench.py reads both)
        self.combine_s = 0.0  # of which in collectives
        self.num_combines = 0

    def __call__(self, moe, h: torch.Tensor, ops) -> tuple[torch.Tensor, torch.Tensor]:
        t0 = time.perf_counter()
        partial, counts = moe.forward(h, ops)  # [T, H] this rank's partial sums, [E]
        if self.comm.size > 1:
            t1 = time.perf_counter()
            partial = self.comm.all_reduce(partial)
            self.combine_s += time.perf_counter() - t1
            self.num_combines += 1
        self.total_s += time.perf_counter() - t0
        return partial, counts


class AllToAllDispatch:
    """The ``alltoall`` dispatch (module docstring): slice, route, send each (token, expert) row
    to its expert's rank, compute there, send back, combine, all-gather.

    expert_owner[e]: the rank holding expert e (engine.parallel.sharding.ShardLayout.expert_owner)."""

    name = "alltoall"

    def __init__(self, comm, expert_owner: tuple[int, ...]):
        self.comm = comm
        size = comm.size
        # each rank's experts, ascending: a source's rows for one rank go in this order
        self.by_rank = [tuple(e for e, r in enumerate(expert_owner) if r == d) for d in range(size)]
        send_order = [e for experts in self.by_rank for e in experts]
        self._pos = torch.tensor([send_order.index(e) for e in range(len(expert_owner))])  # [E]
        self._send_order = send_order
        self.total_s = 0.0
        self.combine_s = 0.0
        self.num_combines = 0

    def __call__(self, moe, h: torch.Tensor, ops) -> tuple[torch.Tensor, torch.Tensor]:
        t_start = time.perf_counter()
        comm, k, E = self.comm, moe.top_k, moe.num_experts
        me, size, dev = comm.rank, comm.size, h.device
        rows = row_splits(h.shape[0], size)
        a = sum(rows[:me])
        x = h[a: a + rows[me]]  # [n, H]: this rank's slice
        n = x.shape[0]
        if n:
            weights, ids = moe.route(x, ops.linear)  # [n, k]
        else:
            weights, ids = x.new_empty((0, k)), torch.empty((0, k), dtype=torch.long, device=dev)
        flat = ids.flatten()  # [n * k]: pair p is token p // k's slot p % k
        counts = torch.bincount(flat, minlength=E)  # [E]
        comm_s = 0.0

        t0 = time.perf_counter()
        table_t = comm.all_gather(counts.view(1, E), [1] * size)  # [size, E]: each slice's counts
        comm_s += time.perf_counter() - t0
        table = table_t.tolist()
        splits = [[sum(table[s][e] for e in self.by_rank[d]) for d in range(size)] for s in range(size)]

        if self._pos.device != dev:
            self._pos = self._pos.to(dev)
        order = torch.argsort(self._pos[flat], stable=True)  # pairs by owner, expert, then token
        t0 = time.perf_counter()
        got = comm.all_to_all(x.index_select(0, order // k), splits)  # [rows sent to me, H]
        comm_s += time.perf_counter() - t0

        # got: per source rank, its rows for each of my experts in ascending order
        mine = self.by_rank[me]
        y = torch.empty_like(got)
        at = [sum(splits[s2][me] for s2 in range(s)) for s in range(size)]  # each source's block
        for j, e in enumerate(mine):
            parts = []
            for s in range(size):
                if table[s][e]:
                    parts.append(torch.arange(at[s], at[s] + table[s][e], device=dev))
                at[s] += table[s][e]
            if not parts:
                continue  # an expert no token picked
            idx = parts[0] if len(parts) == 1 else torch.cat(parts)  # [n_e]
            y.index_copy_(0, idx, moe.expert(j, got.index_select(0, idx), ops))

        t0 = time.perf_counter()
        back = comm.all_to_all(y, [list(col) for col in zip(*splits)])  # [n * k, H], in `order`
        comm_s += time.perf_counter() - t0

        out = torch.zeros_like(x)
        flat_w = weights.flatten()
        start, c = {}, 0
        for e in self._send_order:
            start[e] = c
            c += table[me][e]
        for e in range(E):  # ascending expert ids: the combine order of MoEBlock.forward
            if table[me][e] == 0:
                continue
            pairs = order[start[e]: start[e] + table[me][e]]
            out.index_add_(0, pairs // k, back[start[e]: start[e] + table[me][e]] *
                           flat_w.index_select(0, pairs).unsqueeze(1))
        if n:
            out = moe.add_shared(out, x, ops)

        t0 = time.perf_counter()
        mlp = comm.all_gather(out, rows)  # [T, H] on every rank
        comm_s += time.perf_counter() - t0
        self.combine_s += comm_s
        self.num_combines += 1
        self.total_s += time.perf_counter() - t_start
        return mlp, table_t.sum(0)


def make_dispatch(name: str, comm, expert_owner: tuple[int, ...] = ()):
    """The dispatch/combine `name` over `comm` (engine.parallel.comm.Collectives)."""
    if name == "allreduce":
        return AllReduceDispatch(comm)
    if name == "alltoall":
        if comm.size == 1 or not expert_owner:
            raise ValueError("moe_dispatch: 'alltoall' sends tokens to the ranks holding their experts; "
                             "it needs enable_expert_parallel at tensor_parallel_size > 1 (use 'allreduce')")
        return AllToAllDispatch(comm, expert_owner)
    raise ValueError(f"moe_dispatch: must be one of {DISPATCHES}, got {name!r}")
