"""The reshard plan: which prefill rank's KV heads land in which decode ranks. Plain Python.

A replica at tensor-parallel size tp holds, on each rank, a contiguous range
of the model's global KV heads (``KVLayout.rank_heads``). Moving a prompt's KV
from a prefill replica (tp = a) to a decode replica (tp = b) is a set of
units, each

    (global layers, global KV-head range)   from (prefill rank, local head offset)
                                            to   one or more (decode rank, local head offset)

The block runs come from each transfer's ticket. A head range that several
decode ranks replicate (tp > num_kv_heads) is read once and written to each
of them; of several prefill ranks that replicate a head, the lowest reads it.

``plan_transfer`` builds the plan from the heads each side says it holds;
``check_plan`` refuses, before any byte moves, a plan that does not write every
(layer, head) of every decode rank exactly once from a prefill rank that
holds it, naming the missing or doubled piece. Both ends of a transfer run
both at the handshake.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvtransfer.types import PlanError


@dataclass(frozen=True)
class Placement:
    """Where a unit's heads sit on one rank: the rank and the first local head (index into its cache)."""

    rank: int
    head: int


@dataclass(frozen=True)
class PlanUnit:
    layers: range  # global layer ids
    heads: range  # global KV heads
    src: Placement  # the prefill rank read
    dsts: tuple[Placement, ...]  # every decode rank written


@dataclass(frozen=True)
class TransferPlan:
    num_layers: int
    num_kv_heads: int  # the model's
    src_heads: tuple[range, ...]  # per prefill rank: the global KV heads it holds
    dst_heads: tuple[range, ...]  # per decode rank
    units: tuple[PlanUnit, ...]

    @property
    def is_identity(self) -> bool:
        """Homogeneous: each unit is one prefill rank's whole cache into the same rank's on decode."""
        return all(len(u.dsts) == 1 and u.src.rank == u.dsts[0].rank and u.heads == self.src_heads[u.src.rank]
                   == self.dst_heads[u.src.rank] for u in self.units)


def _holder(ranges: Sequence[range], head: int) -> list[int]:
    return [r for r, heads in enumerate(ranges) if head in heads]


def plan_transfer(num_layers: int, src_heads: Sequence[range], dst_heads: Sequence[range]) -> TransferPlan:
    """Units over every layer, one per run of heads with the same source rank and the same decode ranks.

    A head that no prefill rank holds gets no unit (check_plan names it)."""
    src_heads, dst_heads = tuple(src_heads), tuple(dst_heads)
    num_heads = max([h.stop for h in src_heads + dst_heads] or [0])
    units: list[PlanUnit] = []
    key_prev, start = None, 0
    for head in range(num_heads + 1):
        key = None
        if head < num_heads:
            srcs, dsts = _holder(src_heads, head), tuple(_holder(dst_heads, head))
            key = (srcs[0], dsts) if srcs and dsts else None
        if key != key_prev or head == num_heads:
            if key_prev is not None:
                src, dsts = key_prev
                units.append(PlanUnit(range(num_layers), range(start, head),
                                      Placement(src, start - src_heads[src].start),
                                      tuple(Placement(d, start - dst_heads[d].start) for d in dsts)))
            key_prev, start = key, head
    return TransferPlan(num_layers, num_heads, src_heads, dst_heads, tuple(units))


def check_plan(plan: TransferPlan) -> None:
    """Raise PlanError unless every (layer, KV head) of every decode rank is written exactly once, each unit
    reading heads its prefill rank holds and writing them where its decode rank holds them."""
    L = plan.num_layers
    for head in range(plan.num_kv_heads):
        if not _holder(plan.dst_heads, head):
            raise PlanError(f"kv-head {head} is held by no decode rank")
    for u in plan.units:
        if not u.heads or u.heads.step != 1:
            raise PlanError(f"plan unit with kv-heads {_span(u.heads)}: not a run of heads")
        if not u.layers or u.layers.start < 0 or u.layers.stop > L:
            raise PlanError(f"plan unit for kv-heads {_span(u.heads)} covers layers {_span(u.layers)}, "
                            f"outside the model's {L}")
        _check_placement("prefill", plan.src_heads, u.src, u.heads)
        for d in u.dsts:
            _check_placement("decode", plan.dst_heads, d, u.heads)
    # written[rank][layer][local head]: the prefill ranks that write it
    written = [[[[] for _ in heads] for _ in range(L)] for heads in plan.dst_heads]
    for u in plan.units:
        for d in u.dsts:
            for layer in u.layers:
                for i in range(len(u.heads)):
                    written[d.rank][layer][d.head + i].append(u.src.rank)
    for rank, heads in enumerate(plan.dst_heads):
        for layer in range(L):
            for i, srcs in enumerate(written[rank][layer]):
                if not srcs:
                    raise PlanError(f"decode rank {rank} has no source for layer {layer} kv-head {heads[i]}")
                if len(srcs) > 1:
                    raise PlanError(f"layer {layer} kv-head {heads[i]} of decode rank {rank} written "
                                    f"{_times(len(srcs))} (from prefill ranks {_and(srcs)})")


def _check_placement(side: str, ranges: Sequence[range], p: Placement, heads: range) -> None:
    if not 0 <= p.rank < len(ranges):
        raise PlanError(f"plan names {side} rank {p.rank}; the {side} replica has ranks 0-{len(ranges) - 1}")
    held = ranges[p.rank]
    at = range(held.start + p.head, held.start + p.head + len(heads))
    if p.head < 0 or at != heads or at.stop > held.stop:
        raise PlanError(f"plan puts kv-heads {_span(heads)} at local head {p.head} of {side} rank {p.rank}, "
                        f"which holds kv-heads {_span(held)}")


def _span(r: range) -> str:
    return f"[{r.start}, {r.stop})"


def _times(n: int) -> str:
    return "twice" if n == 2 else f"{n} times"


def _and(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]}"
