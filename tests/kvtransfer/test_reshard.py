"""The reshard plan between a prefill layout (TP=a) and a decode layout (TP=b): every (layer, KV head) of
every decode rank written exactly once, from a prefill rank that holds it; a corrupted plan is refused
with the missing or doubled piece named."""
from __future__ import annotations

import dataclasses

import pytest

from kvtransfer.layout import KVLayout, with_layout
from kvtransfer.reshard import Placement, PlanUnit, TransferPlan, check_plan, plan_transfer
from kvtransfer.types import PlanError

TP = (1, 2, 3, 4)
HEAD_COUNTS = (1, 2, 3, 4, 6, 12)  # with 1, 2 and 3: replicated heads at tp 2-4
NUM_LAYERS = 5


def layout(num_kv_heads: int, tp: int, **kw) -> KVLayout:
    return KVLayout(NUM_LAYERS, num_kv_heads, 8, 16, "float32", tp, **kw)


def allowed(num_kv_heads: int, tp: int) -> bool:
    return num_kv_heads % tp == 0 or tp % num_kv_heads == 0


PAIRS = [(h, a, b) for h in HEAD_COUNTS for a in TP for b in TP if allowed(h, a) and allowed(h, b)]


def move(plan: TransferPlan, src: KVLayout, dst: KVLayout) -> list[dict[tuple[int, int], list[tuple[int, int]]]]:
    """Run the plan on symbolic caches: each prefill rank's (layer, local head) holds (layer, global head);
    returns, per decode rank, what each (layer, local head) received."""
    caches = [{(l, i): (l, h) for l in range(NUM_LAYERS) for i, h in enumerate(src.heads_of(r))}
              for r in range(src.tp_size)]
    out = [{} for _ in range(dst.tp_size)]
    for u in plan.units:
        for l in u.layers:
            for i in range(len(u.heads)):
                value = caches[u.src.rank][(l, u.src.head + i)]
                for d in u.dsts:
                    out[d.rank].setdefault((l, d.head + i), []).append(value)
    return out


def test_every_pair_the_head_counts_allow_is_covered():
    assert len(PAIRS) > 40 and any(a != b for _, a, b in PAIRS)


@pytest.mark.parametrize("num_kv_heads,a,b", PAIRS)
def test_plan_writes_each_decode_rank_exactly_its_heads(num_kv_heads, a, b):
    src, dst = layout(num_kv_heads, a), layout(num_kv_heads, b)
    plan = src.plan_to(dst)  # checked
    got = move(plan, src, dst)
    for r in range(b):
        want = {(l, i): [(l, h)] for l in range(NUM_LAYERS) for i, h in enumerate(dst.heads_of(r))}
        assert got[r] == want, f"decode rank {r}"
    # each global head is read once per layer, however many decode ranks replicate it
    read = sorted(h for u in plan.units for h in u.heads)
    assert read == list(range(num_kv_heads))
    assert plan.is_identity or a != b or a > num_kv_heads  # homogeneous split: whole caches, rank to rank


def test_replicated_heads_are_sent_once_and_written_to_every_rank_that_holds_them():
    src, dst = layout(2, 1), layout(2, 4)  # decode ranks 0, 1 hold head 0; ranks 2, 3 head 1
    plan = src.plan_to(dst)
    assert [(u.heads, u.src, u.dsts) for u in plan.units] == [
        (range(0, 1), Placement(0, 0), (Placement(0, 0), Placement(1, 0))),
        (range(1, 2), Placement(0, 1), (Placement(2, 0), Placement(3, 0)))]
    # prefill replicating: the lowest prefill rank that holds a head reads it
    plan = layout(2, 4).plan_to(layout(2, 1))
    assert [(u.heads, u.src) for u in plan.units] == [(range(0, 1), Placement(0, 0)),
                                                      (range(1, 2), Placement(2, 0))]


def test_the_layout_follows_the_engines_sharding_rule():
    from engine.config import ModelConfig
    from engine.parallel.sharding import ShardLayout

    for kv, tp in [(2, 1), (2, 2), (2, 4), (4, 2), (3, 3), (1, 2), (3, 1), (6, 3)]:
        heads = 3 * max(kv, tp)
        model = ModelConfig("llama", 96, 8 * heads, 12 * tp, NUM_LAYERS, heads, kv, 8)
        for r in range(tp):
            assert layout(kv, tp).heads_of(r) == range(*ShardLayout.for_rank(model, r, tp).kv_head_range)


def corrupt(plan: TransferPlan, units) -> TransferPlan:
    return dataclasses.replace(plan, units=tuple(units))


def test_a_missing_unit_names_the_decode_rank_layer_and_head():
    plan = layout(4, 2).plan_to(layout(4, 2))  # rank r holds heads [2r, 2r + 2)
    with pytest.raises(PlanError, match="decode rank 1 has no source for layer 0 kv-head 2"):
        check_plan(corrupt(plan, plan.units[:1]))


def test_a_unit_missing_one_layer_names_that_layer():
    plan = layout(4, 1).plan_to(layout(4, 2))
    u = plan.units[1]  # heads [2, 4) into decode rank 1
    split = [dataclasses.replace(u, layers=range(0, 3)), dataclasses.replace(u, layers=range(4, NUM_LAYERS))]
    with pytest.raises(PlanError, match="decode rank 1 has no source for layer 3 kv-head 2"):
        check_plan(corrupt(plan, [plan.units[0], *split]))


def test_a_doubled_unit_names_both_prefill_ranks():
    src, dst = layout(1, 2), layout(1, 1)  # both prefill ranks hold head 0 (replicated); rank 0 sends it
    plan = src.plan_to(dst)
    doubled = PlanUnit(range(NUM_LAYERS), range(0, 1), Placement(1, 0), (Placement(0, 0),))
    with pytest.raises(PlanError, match=r"layer 0 kv-head 0 of decode rank 0 written twice \(from prefill ranks 0 "
                                        r"and 1\)"):
        check_plan(corrupt(plan, (*plan.units, doubled)))


def test_a_unit_reading_heads_its_rank_does_not_hold_is_refused():
    plan = layout(4, 2).plan_to(layout(4, 1))
    u = plan.units[1]  # heads [2, 4) from prefill rank 1, local head 0
    with pytest.raises(PlanError, match=r"kv-heads \[2, 4\) at local head 1 of prefill rank 1, which holds "
                                        r"kv-heads \[2, 4\)"):
        check_plan(corrupt(plan, [plan.units[0], dataclasses.replace(u, src=Placement(1, 1))]))
    with pytest.raises(PlanError, match="decode rank 3"):
        check_plan(corrupt(plan, [plan.units[0], dataclasses.replace(u, dsts=(Placement(3, 0),))]))
    with pytest.raises(PlanError, match="outside the model's 5"):
        check_plan(corrupt(plan, [plan.units[0], dataclasses.replace(u, layers=range(0, 6))]))


def test_a_decode_layout_that_drops_a_head_is_refused():
    holey = KVLayout(NUM_LAYERS, 2, 8, 16, "float32", 2, rank_heads=(range(0, 1), range(0, 1)))
    with pytest.raises(PlanError, match="kv-head 1 is held by no decode rank"):
        layout(2, 1).plan_to(holey)


def test_an_advertised_layout_with_a_gap_is_refused_by_its_plan():
    """A prefill replica whose ranks say they hold heads [0, 1) and [0, 1): head 1 has no source."""
    bad = KVLayout(NUM_LAYERS, 2, 8, 16, "float32", 2, rank_heads=(range(0, 1), range(0, 1)))
    with pytest.raises(PlanError, match="decode rank 0 has no source for layer 0 kv-head 1"):
        bad.plan_to(layout(2, 1))
    with pytest.raises(PlanError, match="decode rank 1 has no source for layer 0 kv-head 1"):
        bad.plan_to(layout(2, 2))


def test_the_fingerprint_carries_the_layout_and_reads_back():
    lay = layout(2, 4)
    fp = with_layout({"architecture": "llama", "num_kv_heads": "1", "tp_size": "1"}, lay)
    assert (fp["num_kv_heads"], fp["tp_size"], fp["kv_heads"]) == ("2", "4", "0-1,0-1,1-2,1-2")
    assert KVLayout.from_fingerprint(fp) == lay
    with pytest.raises(ValueError, match="num_layers is '3'"):
        with_layout({"num_layers": "3"}, lay)
    with pytest.raises(ValueError, match="no 'head_dim'"):
        KVLayout.from_fingerprint({k: v for k, v in fp.items() if k != "head_dim"})
    with pytest.raises(ValueError, match="tp_size: 3 must divide num_kv_heads"):
        layout(2, 3)


def test_plan_is_plain_python():
    plan = plan_transfer(2, [range(0, 2)], [range(0, 1), range(1, 2)])
    check_plan(plan)
    assert len(plan.units) == 2
