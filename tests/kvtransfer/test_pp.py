"""The KV hand-off from a pipeline-parallel prefill: each prefill rank holds only its layers (a LOCAL list),
and every byte must land in the decode layer of the same GLOBAL id. The caches here encode (layer, head,
block, slot) in every value, so an off-by-range pairing (a rank's local layer 0 taken for global layer 0)
lands wrong values and fails. Real KVSender and KVReceiver over loopback (grpc, nccl-on-gloo); a prefill
layout whose ranks leave a layer out or hold one twice is refused at the handshake naming the layers, before
a byte moves; a decode layout of more than one pipeline stage is refused with the reason; an older peer's
fingerprint without the pipeline fields is one stage."""
from __future__ import annotations

import time
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch

from engine.block_pool import BlockPool
from kvtransfer import HandshakeError, KVReceiver, KVSender
from kvtransfer.config import ReceiverConfig, SenderConfig
from kvtransfer.layout import LAYOUT_FIELDS, KVLayout
from kvtransfer.types import PlanError
from tests.kvtransfer.factories import SECRET, wait_results

NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, BLOCK = 4, 2, 8, 16
NUM_BLOCKS = 24
NUM_TOKENS = 70  # 5 blocks, the last partial
SRC_BLOCKS = [9, 3, 4, 5, 17]  # scattered, a run in the middle


def layout(tp: int = 1, pp: int = 1, split=None, **kw) -> KVLayout:
    return KVLayout(NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, BLOCK, "float32", tp, pp_size=pp,
                    layer_split=tuple(split) if split else None, **kw)


def code(layer: int, head: int, block: int) -> torch.Tensor:
    """``[2, block_size, head_dim]``: every value of (layer, global head, prefill block) distinct and exact
    in float32 (layer << 17 | head << 14 | block << 8 | kv, position, dim)."""
    slot = torch.arange(2 * BLOCK * HEAD_DIM, dtype=torch.float32).view(2, BLOCK, HEAD_DIM)
    return slot + float((layer << 17) | (head << 14) | (block << 8))


def encoded_caches(src: KVLayout) -> list[list[torch.Tensor]]:
    """rank -> LOCAL layer -> ``[blocks, 2, block, heads, dim]``, each value its global (layer, head, block)."""
    out = []
    for rank in range(src.num_ranks):
        heads = src.heads_of(rank)
        layers = []
        for layer in src.layers_of(rank):
            kv = torch.empty(NUM_BLOCKS, 2, BLOCK, len(heads), HEAD_DIM)
            for b in range(NUM_BLOCKS):
                for i, h in enumerate(heads):
                    kv[b, :, :, i] = code(layer, h, b)
            layers.append(kv)
        out.append(layers)
    return out


def check_landed(dst: KVLayout, caches: list[list[torch.Tensor]], dst_blocks: list[int]) -> None:
    """Each decode rank's layer l, head h, block dst_blocks[i] holds exactly prefill's (l, h, SRC_BLOCKS[i])."""
    for rank in range(dst.tp_size):
        for layer in range(NUM_LAYERS):
            for i, h in enumerate(dst.heads_of(rank)):
                for src_b, dst_b in zip(SRC_BLOCKS, dst_blocks):
                    got = caches[rank][layer][dst_b, :, :, i]
                    assert torch.equal(got, code(layer, h, src_b)), \
                        f"decode rank {rank} layer {layer} head {h} block {dst_b}: got the code of " \
                        f"layer {int(got[0, 0, 0]) >> 17}, head {(int(got[0, 0, 0]) >> 14) & 7}"


def decode_caches(dst: KVLayout) -> list[list[torch.Tensor]]:
    return [[torch.zeros(NUM_BLOCKS, 2, BLOCK, len(dst.heads_of(r)), HEAD_DIM) for _ in range(NUM_LAYERS)]
            for r in range(dst.tp_size)]


def pipeline_hook_order(src: KVLayout) -> list[int]:
    """The global layer ids in the order a pipeline's hooks fire: stage by stage."""
    return [layer for stage in range(src.pp_size) for layer in src.layers_of(stage * src.tp_size)]


# name: (prefill pp, tp, split), decode tp
CASES = {
    "pp2-tp1": ((2, 1, None), 1),
    "pp2[1,3]-tp1": ((2, 1, [1, 3]), 1),
    "pp2[1,3]-tp2": ((2, 1, [1, 3]), 2),
    "pp2xtp2-tp2": ((2, 2, None), 2),
    "pp2xtp2-tp1": ((2, 2, [3, 1]), 1),
    "pp3-tp1": ((3, 1, None), 1),
}


@contextmanager
def pair(src: KVLayout, dst: KVLayout, transport: str):
    """A sender of `src`'s encoded caches and a receiver of `dst` (its caches zero); both closed after, every
    block free."""
    dst_caches = decode_caches(dst)
    pool = BlockPool(NUM_BLOCKS)
    rx = KVReceiver(dst_caches, pool, {"architecture": "llama"}, ReceiverConfig(SECRET, transport), layout=dst)
    tx = KVSender({"architecture": "llama"}, SenderConfig(SECRET, max_chunk_bytes=4096), layout=src)
    try:
        yield tx, rx, dst_caches
    finally:
        tx.close()
        rx.close()
    assert pool.is_fully_free()


def commit_and_check(tx, rx, dst: KVLayout, dst_caches, ticket) -> None:
    tx.commit("r", 11)
    results = wait_results(tx, rx, count=2)
    assert [r.status for r in results] == ["DONE", "DONE"], [r.error for r in results]
    check_landed(dst, dst_caches, ticket.block_ids)
    rx.pool.free(rx.release("r"))


@pytest.mark.parametrize("transport", ["grpc", "nccl"])
@pytest.mark.parametrize("name", list(CASES))
def test_every_byte_lands_at_its_global_layer(name, transport):
    (pp, tp, split), dst_tp = CASES[name]
    src, dst = layout(tp, pp, split), layout(dst_tp)
    with pair(src, dst, transport) as (tx, rx, dst_caches):
        ticket = rx.reserve("r", NUM_TOKENS)
        tx.start(ticket, encoded_caches(src), SRC_BLOCKS, NUM_TOKENS)
        for layer in pipeline_hook_order(src):
            tx.push_layer("r", layer)
        commit_and_check(tx, rx, dst, dst_caches, ticket)


def test_a_pipeline_ranks_layers_leave_at_its_own_hooks():
    """PP=2 split [1, 3] at TP=1: rank 0's layer 0 lands while rank 1 has not reached a layer yet, and each of
    rank 1's layers as its hook fires, before the commit."""
    src, dst = layout(1, 2, [1, 3]), layout(1)
    with pair(src, dst, "local") as (tx, rx, dst_caches):
        def landed() -> list[int]:
            time.sleep(0.3)  # the sender's worker thread moves what was queued
            return [layer for layer in range(NUM_LAYERS) if dst_caches[0][layer][ticket.block_ids[0]].any()]

        ticket = rx.reserve("r", NUM_TOKENS)
        tx.start(ticket, encoded_caches(src), SRC_BLOCKS, NUM_TOKENS)
        tx.push_layer("r", 0)
        assert landed() == [0]
        tx.push_layer("r", 1)
        tx.push_layer("r", 2)
        assert landed() == [0, 1, 2]
        tx.push_layer("r", 3)
        assert landed() == [0, 1, 2, 3]
        commit_and_check(tx, rx, dst, dst_caches, ticket)


# ---- the plan --------------------------------------------------------------------------------------------
def test_the_plan_reads_each_layer_from_the_rank_that_holds_it():
    plan = layout(2, 2, [1, 3]).plan_to(layout(1))
    got = sorted((u.layers.start, u.layers.stop, u.heads.start, u.src.rank) for u in plan.units)
    # ranks 0, 1: layer 0, heads 0 and 1; ranks 2, 3: layers 1-3
    assert got == [(0, 1, 0, 0), (0, 1, 1, 1), (1, 4, 0, 2), (1, 4, 1, 3)]
    assert not plan.is_identity


@pytest.mark.parametrize("rank_layers,error", [
    ((range(0, 2), range(3, 4)), "prefill layout: layer 2 is held by no rank"),
    ((range(0, 1), range(2, 3)), "prefill layout: layer 1 is held by no rank"),
    ((range(0, 4), range(2, 4)), "prefill layout: layers 2-3 are held by ranks 0 and 1"),
    ((range(0, 3), range(1, 4)), "prefill layout: layers 1-2 are held by ranks 0 and 1"),
    ((range(0, 2), range(2, 5)), "prefill layout: rank 1 holds layers 2-4, outside the model's 4"),
])
def test_a_gap_or_an_overlap_is_named(rank_layers, error):
    with pytest.raises(PlanError, match=error):
        layout(1, 2, rank_layers=rank_layers).plan_to(layout(1))


def test_the_layers_are_checked_per_tensor_parallel_rank():
    """PP=2 x TP=2: ranks 0 and 2 hold tp rank 0's heads; ranks 1 and 3 tp rank 1's. Rank 3 misses layer 3."""
    bad = (range(0, 2), range(0, 2), range(2, 4), range(2, 3))
    with pytest.raises(PlanError, match="layer 3 is held by no rank of ranks 1 and 3 \\(tp rank 1.s heads\\)"):
        layout(2, 2, rank_layers=bad).plan_to(layout(2))


def test_a_decode_layout_of_two_pipeline_stages_is_refused_with_the_reason():
    with pytest.raises(PlanError, match="decode layout of pp_size 2 refused: a decode replica runs one pipeline"):
        layout(1).plan_to(layout(1, 2))
    dst = layout(1, 2)
    with pytest.raises(ValueError, match="decode KV layout: pp_size 2 refused: .*tensor_parallel_size"):
        KVReceiver(decode_caches(layout(1)) * 2, BlockPool(NUM_BLOCKS), {}, ReceiverConfig(SECRET, "local"),
                   layout=dst)


def test_the_fingerprint_carries_the_layer_ranges_and_an_old_one_means_one_stage():
    src = layout(2, 2, [1, 3])
    fp = src.fingerprint_fields()
    assert fp["pp_size"] == "2" and fp["kv_layers"] == "0-1,0-1,1-4,1-4"
    assert KVLayout.from_fingerprint(fp) == src.__class__(**{**src.__dict__, "layer_split": None})
    old = {k: v for k, v in layout(2).fingerprint_fields().items() if k not in ("pp_size", "kv_layers")}
    theirs = KVLayout.from_fingerprint(old)
    assert theirs.pp_size == 1 and theirs.rank_layers == (range(0, 4), range(0, 4))
    assert {"pp_size", "kv_layers"} <= set(LAYOUT_FIELDS)


def test_a_sender_accepts_an_old_receiver_and_refuses_a_pipelined_one():
    tx = KVSender({"architecture": "llama"}, SenderConfig(SECRET), layout=layout(1, 2))
    try:
        old = {k: v for k, v in layout(1).fingerprint_fields().items() if k not in ("pp_size", "kv_layers")}
        plan = tx._plan_for(SimpleNamespace(peer_fingerprint=old))
        assert [(u.layers, u.src.rank) for u in plan.units] == [(range(0, 2), 0), (range(2, 4), 1)]
        with pytest.raises(HandshakeError, match="pp_size 2 x tp_size 1 into pp_size 2 x tp_size 1: decode "
                                                 "layout of pp_size 2 refused"):
            tx._plan_for(SimpleNamespace(peer_fingerprint=layout(1, 2).fingerprint_fields()))
    finally:
        tx.close()


def test_caches_are_checked_per_rank_in_local_layers():
    src = layout(1, 2, [1, 3])
    caches = encoded_caches(src)
    src.check_caches(caches)
    with pytest.raises(ValueError, match=r"rank 1 has 4 layers, expected 3 \(layers 1-3\)"):
        src.check_caches([caches[0], caches[1] + caches[0]])
    with pytest.raises(ValueError, match="2 ranks, the layout has pp_size 3 x tp_size 1"):
        layout(1, 3).check_caches(caches)
    with pytest.raises(ValueError, match="pipeline_layer_split: .*sums to 5 layers; the model has 4"):
        layout(1, 2, [2, 3])


# ---- refused at the handshake, before a byte moves -------------------------------------------------------
@pytest.mark.parametrize("transport", ["grpc", "nccl"])
@pytest.mark.parametrize("rank_layers,error", [
    ((range(0, 2), range(3, 4)), "layer 2 is held by no rank"),
    ((range(0, 4), range(2, 4)), "layers 2-3 are held by ranks 0 and 1"),
])
def test_the_receiver_refuses_a_gap_or_an_overlap_before_bytes_move(rank_layers, error, transport):
    wrong = layout(1, 2, rank_layers=rank_layers)
    caches = [[torch.ones(NUM_BLOCKS, 2, BLOCK, NUM_KV_HEADS, HEAD_DIM) for _ in r] for r in rank_layers]
    dst = layout(1)
    dst_caches = decode_caches(dst)
    pool = BlockPool(NUM_BLOCKS)
    rx = KVReceiver(dst_caches, pool, {}, ReceiverConfig(SECRET, transport), layout=dst)
    tx = KVSender({}, SenderConfig(SECRET), layout=wrong)
    try:
        with pytest.raises(HandshakeError, match=f"handshake refused: KV layout of pp_size 2 x tp_size 1 into "
                                                 f"tp_size 1: prefill layout: {error}"):
            tx.connect(rx.endpoint)
        ticket = rx.reserve("r", NUM_TOKENS)
        tx.start(ticket, caches, SRC_BLOCKS, NUM_TOKENS)
        for layer in range(NUM_LAYERS):
            tx.push_layer("r", layer)
        tx.commit("r", 7)
        [sent] = wait_results(tx, count=1)
        assert sent.status == "FAILED" and error in sent.error, sent.error
        assert all(not kv.any() for kv in dst_caches[0]), "bytes moved despite the refused layout"
        assert rx.core.num_dropped_chunks == 0
        rx.abort("r")
        assert [r.status for r in rx.poll()] == ["FAILED"]
    finally:
        tx.close()
        rx.close()
    assert pool.is_fully_free()


def test_engine_kv_reads_the_groups_rank_layers_when_it_has_them():
    """The stage wiring's contract with a pipeline-parallel engine: `rank_layers()` (per rank, its global
    layers) and `rank_kv_caches()` (per rank, its LOCAL list) make the layout the sender plans from."""
    from kvtransfer.layout import engine_kv

    src = layout(1, 2, [1, 3])
    caches = encoded_caches(src)
    group = SimpleNamespace(rank_layers=lambda: [range(0, 1), range(1, 4)], rank_kv_caches=lambda: caches)
    core = SimpleNamespace(config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=2,
                                                  pipeline_layer_split=(1, 3)),
                           tp_group=group, kv_caches=caches[0],
                           model_config=SimpleNamespace(num_layers=NUM_LAYERS, num_kv_heads=NUM_KV_HEADS),
                           kv_spec=SimpleNamespace(head_dim=HEAD_DIM, block_size=BLOCK))
    got, got_caches = engine_kv(core)
    assert got == src and got_caches is caches
    got.check_caches(got_caches)
