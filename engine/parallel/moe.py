"""Expert dispatch and combine across a tensor-parallel group, chosen by name
(`EngineConfig.moe_dispatch`, so a prefill stage and a decode stage may differ).

``allreduce`` (the one implemented): every rank routes every token (the router
is replicated), runs the experts it holds on the tokens routed to them, and
returns its partial sum; the MLP's all-reduce, the same one a dense MLP's
down_proj takes, adds the ranks' partials. There is no dispatch step at all.

Why this is the right choice on CPU ranks (shm, gloo): after attention's
o_proj all-reduce, every rank already holds every token's hidden state, so
the all-gather that a dispatch would start with is free, and the combine is
the all-reduce the layer pays anyway: one collective per sparse layer, of
[tokens, hidden], with expert parallelism or without. On shared memory a
collective's cost is its synchronisation (microseconds), not its bytes, so
adding an all-to-all pair would only add two more synchronisations per layer.

What an all-to-all changes (``alltoall``, NCCL): with sequence- or data-parallel
attention the activations are not replicated, and each rank sends each token
only to the ranks holding its top-k experts and gets the outputs back: the bytes
moved per layer fall from hidden x tokens x (size - 1) / size x 2 (ring
all-reduce) to about hidden x tokens x top_k x (size - 1) / size each way, and
no rank touches a token none of its experts takes. It pays off across GPUs and
hosts; here it is refused (EngineConfig.validate) until a GPU backend exists.
"""
from __future__ import annotations

import time

import torch

DISPATCHES = ("allreduce", "alltoall")


class AllReduceCombine:
    """The ``allreduce`` dispatch: tokens are already on every rank; the combine is the sum."""

    name = "allreduce"

    def __init__(self, comm):
        self.comm = comm
        self.combine_s = 0.0  # wall time in the combine (engine/moe_bench.py reads it)
        self.num_combines = 0

    def __call__(self, partial: torch.Tensor) -> torch.Tensor:  # [T, H] partial sums -> [T, H]
        if self.comm.size == 1:
            return partial
        t0 = time.perf_counter()
        out = self.comm.all_reduce(partial)
        self.combine_s += time.perf_counter() - t0
        self.num_combines += 1
        return out


def make_combine(name: str, comm):
    """The dispatch/combine `name` over `comm` (engine.parallel.comm.Collectives)."""
    if name == "allreduce":
        return AllReduceCombine(comm)
    if name == "alltoall":
        raise ValueError("moe_dispatch: 'alltoall' is not implemented for CPU collectives (shm, gloo); "
                         "use 'allreduce'")
    raise ValueError(f"moe_dispatch: must be one of {DISPATCHES}, got {name!r}")
