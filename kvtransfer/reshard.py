"""The reshard plan: which prefill rank's layers and KV heads land in which decode ranks. Plain Python.

A replica at tensor-parallel size tp holds, on each rank, a contiguous range
of the model's global KV heads (``KVLayout.rank_heads``). Moving a prompt's KV
from a prefill replica (tp = a) to a decode replica (tp = b) is a set of
units, each

    (global layers, global KV-head range)   from (prefill rank, local head offset)
                                            to   one or more (decode rank, local head offset)

The block runs come from each transfer's ticket. A head range that several
decode ranks replicate (tp > num_kv_heads) is read once and written to each
of them; of several prefill ranks that replicate a head, the lowest reads it.

Pipeline parallelism on the prefill side: prefill rank r holds only the
global layers ``src_layers[r]`` (rank = pp_rank * tp + tp_rank), so a unit's
layers are a run of global layers that one rank holds, and its source is the
rank holding those layers and heads. Units are keyed by global layer id, never
by the position of a buffer in a rank's (local) list.

``plan_transfer`` builds the plan from the layers and heads each side says it
holds; ``check_plan`` refuses, before any byte moves, a prefill layout whose
pipeline ranks leave a layer to no rank or give one to two (naming the layers
and ranks), and a plan that does not write every (layer, head) of every decode
rank exactly once from a prefill rank that holds it, naming the missing or
doubled piece. Both ends of a transfer run both at the handshake.
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
    layers: range  # global layer ids (all held by the src rank)
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
    src_layers: tuple[range, ...] = ()  # per prefill rank: the global layers it holds (empty: every rank all)
    src_tp: int = 0  # the prefill replica's tp_size (rank = pp_rank * tp + tp_rank); 0: len(src_heads)

    def layers_of(self, rank: int) -> range:
        return self.src_layers[rank] if self.src_layers else range(self.num_layers)

    @property
    def is_identity(self) -> bool:
        """Homogeneous: each unit is one prefill rank's whole cache into the same rank's on decode."""
        return len(self.src_heads) == len(self.dst_heads) and all(
            len(u.dsts) == 1 and u.src.rank == u.dsts[0].rank and u.heads == self.src_heads[u.src.rank]
            == self.dst_heads[u.src.rank] and u.layers == range(self.num_layers) for u in self.units)


def _holder(ranges: Sequence[range], head: int) -> list[int]:
    return [r for r, heads in enumerate(ranges) if head in heads]


def plan_transfer(num_layers: int, src_heads: Sequence[range], dst_heads: Sequence[range],
                  src_layers: Sequence[range] | None = None, src_tp: int = 0) -> TransferPlan:
    """Units: per run of global layers, one per run of heads with the same source rank (the lowest that holds
    those layers and heads) and the same decode ranks. src_layers: per prefill rank its global layers (None:
    every rank all of them).

    A (layer, head) that no prefill rank holds gets no unit (check_plan names it)."""
    src_heads, dst_heads = tuple(src_heads), tuple(dst_heads)
    src_layers = tuple(src_layers) if src_layers is not None else ()
    num_heads = max([h.stop for h in src_heads + dst_heads] or [0])
    dsts_of = [tuple(_holder(dst_heads, head)) for head in range(num_heads)]
    units: list[PlanUnit] = []
    open_units: dict[tuple, int] = {}  # (heads, src, dsts) of the previous layer -> its unit's index
    for layer in range(num_layers):
        holds = [r for r in range(len(src_heads)) if not src_layers or layer in src_layers[r]]
        runs, key_prev, start = [], None, 0
        for head in range(num_heads + 1):
            key = None
            if head < num_heads:
                srcs = [r for r in holds if head in src_heads[r]]
                key = (srcs[0], dsts_of[head]) if srcs and dsts_of[head] else None
            if key != key_prev or head == num_heads:
                if key_prev is not None:
                    runs.append((range(start, head), *key_prev))
                key_prev, start = key, head
        still_open = {}
        for heads, src, dsts in runs:  # extend the previous layer's unit of the same heads, source and targets
            i = open_units.get((heads, src, dsts))
            if i is not None:
                u = units[i]
                units[i] = PlanUnit(range(u.layers.start, layer + 1), u.heads, u.src, u.dsts)
            else:
                i = len(units)
                units.append(PlanUnit(range(layer, layer + 1), heads,
                                      Placement(src, heads.start - src_heads[src].start),
                                      tuple(Placement(d, heads.start - dst_heads[d].start) for d in dsts)))
            still_open[(heads, src, dsts)] = i
        open_units = still_open
    return TransferPlan(num_layers, num_heads, src_heads, dst_heads, tuple(units), src_layers, src_tp)


def checklayer_span(num_layers: int, src_layers: Sequence[range], tp: int) -> None:
    """Raise PlanError unless the prefill ranks of each tensor-parallel rank (ranks t, t + tp, t + 2 tp, ...:
    one per pipeline stage) hold every global layer exactly once, naming the layers no rank holds or the layers
    two ranks hold."""
    tp = tp or len(src_layers)
    for r, layers in enumerate(src_layers):
        if layers.start < 0 or layers.stop > num_layers:
            raise PlanError(f"prefill layout: rank {r} holds {layer_span(layers)}, outside the model's "
                            f"{num_layers} (0-{num_layers - 1})")
    for column in range(tp):
        ranks = list(range(column, len(src_layers), tp))
        holders = [[r for r in ranks if layer in src_layers[r]] for layer in range(num_layers)]
        among = f" of ranks {_and(ranks)} (tp rank {column}'s heads)" if tp > 1 else ""
        for layer_run, held_by in _runs(holders):
            if not held_by:
                raise PlanError(f"prefill layout: {layer_span(layer_run)} {_is(layer_run)} held by no rank{among}")
            if len(held_by) > 1:
                raise PlanError(f"prefill layout: {layer_span(layer_run)} {_is(layer_run)} held by ranks "
                                f"{_and(held_by)}")


def _runs(values: list) -> list[tuple[range, object]]:
    """Runs of equal consecutive values: [(indices, value)]."""
    out: list[tuple[range, object]] = []
    for i, v in enumerate(values):
        if out and out[-1][1] == v:
            out[-1] = (range(out[-1][0].start, i + 1), v)
        else:
            out.append((range(i, i + 1), v))
    return out


def layer_span(r: range) -> str:
    """``layer 3`` or ``layers 2-3`` (both ends included): for messages."""
    return f"layers {r.start}-{r.stop - 1}" if len(r) > 1 else f"layer {r.start}"


def _is(r: range) -> str:
    return "are" if len(r) > 1 else "is"


def check_plan(plan: TransferPlan) -> None:
    """Raise PlanError unless the prefill ranks' layers cover every layer once (check_layers), and every
    (layer, KV head) of every decode rank is written exactly once, each unit reading layers and heads its
    prefill rank holds and writing them where its decode rank holds them."""
    L = plan.num_layers
    if plan.src_layers:
        if len(plan.src_layers) != len(plan.src_heads):
            raise PlanError(f"prefill layout: layers for {len(plan.src_layers)} ranks, heads for "
                            f"{len(plan.src_heads)}")
        checklayer_span(L, plan.src_layers, plan.src_tp)
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
        held = plan.layers_of(u.src.rank)
        if u.layers.start < held.start or u.layers.stop > held.stop:
            raise PlanError(f"plan reads {layer_span(u.layers)} from prefill rank {u.src.rank}, which holds "
                            f"{layer_span(held)}")
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
