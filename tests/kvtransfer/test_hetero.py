"""Heterogeneous tensor parallelism: a prompt prefilled on an engine at TP=a, its KV moved through the real
KVSender and KVReceiver over loopback (grpc, nccl-on-gloo) into an engine at TP=b, layer by layer from the
forward pass's hook, decodes to exactly `engine.LLM` TP=1's greedy fp32 tokens; every pool free after.
A layout whose plan has a gap is refused at the handshake, before a byte moves."""
from __future__ import annotations

import os
import time
from types import SimpleNamespace

import pytest
import torch

from engine.kv_cache import model_fingerprint
from engine.llm import LLM
from engine.parallel.shm import SEGMENT_PREFIX, SHM_DIR
from engine.sampling import SamplingParams
from engine.sequence import Sequence, SequenceStatus
from kvtransfer import HandshakeError, KVReceiver, KVSender
from kvtransfer.config import ReceiverConfig, SenderConfig
from kvtransfer.layout import KVLayout, engine_kv
from tests.engine.factories import random_prompts, save_tiny_model
from tests.kvtransfer.factories import SECRET, wait_results

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
ENGINE = dict(dtype="float32", num_kv_blocks=48, max_num_batched_tokens=64)
LENGTHS = [5, 23, 40, 16]  # one block, a partial second, three, exactly one full block
# name: (checkpoint overrides, (prefill tp, decode tp)). The tiny llama has 4 heads and 2 KV heads.
CASES = {
    "gqa-1-2": ({}, (1, 2)),
    "gqa-2-1": ({}, (2, 1)),
    "gqa-2-2": ({}, (2, 2)),
    "kv3-3-1": ({"num_attention_heads": 6, "num_key_value_heads": 3, "hidden_size": 48, "intermediate_size": 48},
                (3, 1)),
    "mqa-replicated-1-2": ({"num_key_value_heads": 1}, (1, 2)),  # both decode ranks hold KV head 0
}


def kv_segments() -> set[str]:
    """This process's tensor-parallel segments (the group's and its ranks' KV caches); other processes on the
    machine make their own."""
    return {n for n in os.listdir(SHM_DIR) if n.startswith(f"{SEGMENT_PREFIX}{os.getpid()}-")}


def endpoints(llm: LLM):
    layout, caches = engine_kv(llm.core)
    return layout, caches, model_fingerprint(llm.core.model_config, llm.core.kv_spec)


def disaggregated(prefill: LLM, decode: LLM, prompts: list[list[int]], transport: str, tag: str) -> list[list[int]]:
    """Prefill each prompt on `prefill`, push its KV layer by layer into `decode`'s reserved blocks, decode there."""
    p_layout, p_caches, p_fp = endpoints(prefill)
    d_layout, d_caches, d_fp = endpoints(decode)
    rx = KVReceiver(d_caches, decode.core.pool, d_fp, ReceiverConfig(SECRET, transport), layout=d_layout)
    tx = KVSender(p_fp, SenderConfig(SECRET, max_chunk_bytes=2048), layout=p_layout)  # several chunks per unit
    try:
        rids = [f"{tag}-{i}" for i in range(len(prompts))]
        tickets = {rid: rx.reserve(rid, len(p)) for rid, p in zip(rids, prompts)}
        seqs = {rid: Sequence(rid, list(p), GREEDY, prefill_only=True) for rid, p in zip(rids, prompts)}
        for seq in seqs.values():
            prefill.core.add(seq)

        def on_batch(sched):  # the prefill stage's pattern: start the sends that finish in this pass
            starting = [s.seq.request_id for s in sched.scheduled if s.samples]
            for rid in starting:
                t = tickets[rid]
                tx.start(t, p_caches, seqs[rid].block_ids[:len(t.block_ids)], len(seqs[rid].prompt_token_ids))
            return tx.hook(*starting) if starting else None

        first: dict[str, int] = {}
        while prefill.core.has_unfinished():
            for out in prefill.core.step(on_batch):
                assert out.seq.status == SequenceStatus.FINISHED_LENGTH
                first[out.seq.request_id] = out.new_token_ids[0]
                tx.commit(out.seq.request_id, out.new_token_ids[0])
        results = wait_results(tx, rx, count=2 * len(prompts), timeout_s=60)
        assert sorted(r.status for r in results) == ["DONE"] * 2 * len(prompts), [r.error for r in results]
        for seq in seqs.values():
            prefill.core.free_prefilled(seq)  # the sender reported DONE: the receiver acked for every decode rank
        outs = {}
        for rid, p in zip(rids, prompts):
            seq = Sequence(rid, list(p), GREEDY)
            assert not decode.core.admit_prefilled(seq, rx.release(rid), first[rid])
            outs[rid] = seq
        while decode.core.has_unfinished():
            decode.core.step()
        return [outs[rid].output_token_ids for rid in rids]
    finally:
        tx.close()
        rx.close()


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    over, tps = CASES[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    save_tiny_model(folder, "llama", **over)
    prompts = random_prompts(len(LENGTHS), 96, LENGTHS, seed=4)
    with LLM(str(folder), **ENGINE) as ref:
        want = [o.token_ids for o in ref.generate(prompts, GREEDY)]
    return request.param, folder, tps, prompts, want


def test_heterogeneous_tp_decodes_tp1s_greedy_tokens(case):
    name, folder, (a, b), prompts, want = case
    before = kv_segments()
    with LLM(str(folder), tensor_parallel_size=a, **ENGINE) as prefill, \
            LLM(str(folder), tensor_parallel_size=b, **ENGINE) as decode:
        assert len(engine_kv(prefill.core)[1]) == a and len(engine_kv(decode.core)[1]) == b
        for transport in ("grpc", "nccl"):
            got = disaggregated(prefill, decode, prompts, transport, tag=transport)
            assert got == want, f"{name} over {transport}: TP {a} -> {b} diverged from TP=1"
            assert prefill.core.pool.is_fully_free() and decode.core.pool.is_fully_free()
    assert kv_segments() <= before, "a KV cache segment outlived its engine"


@pytest.fixture(scope="module")
def gqa(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gqa-plan")
    save_tiny_model(folder, "llama")
    return folder


@pytest.mark.parametrize("transport", ["grpc", "local"])
def test_a_layout_with_a_gap_is_refused_before_bytes_move(gqa, transport):
    """A prefill replica at TP=2 whose ranks claim KV head 0 twice (head 1 unclaimed): the receiver refuses
    the handshake naming the missing piece, writes nothing, and every pool ends free."""
    with LLM(str(gqa), tensor_parallel_size=2, **ENGINE) as prefill, LLM(str(gqa), **ENGINE) as decode:
        p_layout, p_caches, p_fp = endpoints(prefill)
        d_layout, d_caches, d_fp = endpoints(decode)
        wrong = KVLayout(p_layout.num_layers, 2, p_layout.head_dim, p_layout.block_size, p_layout.dtype, 2,
                         rank_heads=(range(0, 1), range(0, 1)))
        rx = KVReceiver(d_caches, decode.core.pool, d_fp, ReceiverConfig(SECRET, transport), layout=d_layout)
        tx = KVSender(p_fp, SenderConfig(SECRET), layout=wrong)
        for layer in p_caches[0] + p_caches[1]:
            layer.fill_(1.0)  # what would land, were anything sent
        ticket = rx.reserve("r", 20)
        src = prefill.core.pool.allocate(2)
        tx.start(ticket, p_caches, src, 20)
        for layer in range(p_layout.num_layers):
            tx.push_layer("r", layer)
        tx.commit("r", 7)
        [sent] = wait_results(tx, count=1)
        assert sent.status == "FAILED"
        assert "decode rank 0 has no source for layer 0 kv-head 1" in sent.error, sent.error
        assert all(not layer.any() for layer in d_caches[0]), "bytes moved despite the refused plan"
        assert rx.core.num_dropped_chunks == 0 and rx.poll() == []  # nothing reached the ticket: still reserved
        rx.abort("r")
        assert [r.status for r in rx.poll()] == ["FAILED"]
        prefill.core.pool.free(src)
        tx.close()
        rx.close()
        assert prefill.core.pool.is_fully_free() and decode.core.pool.is_fully_free()


def test_the_sender_checks_the_plan_too():
    """The receiver's advertised layout is checked on the sender's side as well (a receiver that let a bad
    plan through, or an older one): refused with the piece named, before the link is used."""
    mine = KVLayout(2, 2, 8, 16, "float32", 1)
    tx = KVSender({"architecture": "llama"}, SenderConfig(SECRET), layout=mine)
    try:
        holey = KVLayout(2, 2, 8, 16, "float32", 2, rank_heads=(range(0, 1), range(0, 1)))
        fine = KVLayout(2, 2, 8, 16, "float32", 2)
        assert len(tx._plan_for(SimpleNamespace(peer_fingerprint=fine.fingerprint_fields())).units) == 2
        # the decode side says both of its ranks hold head 0: head 1 would go nowhere
        with pytest.raises(HandshakeError, match="plan refused: .*kv-head 1 is held by no decode rank"):
            tx._plan_for(SimpleNamespace(peer_fingerprint=holey.fingerprint_fields()))
        with pytest.raises(HandshakeError, match="receiver's fingerprint has no 'num_layers'"):
            tx._plan_for(SimpleNamespace(peer_fingerprint={}))
    finally:
        tx.close()


def test_a_tp_sender_sends_a_layer_once_every_rank_has_written_it():
    """Rank 0's hook of layer l runs before that layer's all-reduces, when another rank may still be writing
    its KV of layer l: layer l goes once the hook of layer l + 1 ran, the last layer at commit."""
    from engine.block_pool import BlockPool

    src_layout, dst_layout = KVLayout(3, 2, 8, 16, "float32", 2), KVLayout(3, 2, 8, 16, "float32", 1)
    src = [[torch.randn(4, 2, 16, 1, 8) for _ in range(3)] for _ in range(2)]
    dst = [torch.zeros(4, 2, 16, 2, 8) for _ in range(3)]
    pool = BlockPool(4)
    rx = KVReceiver(dst, pool, {}, ReceiverConfig(SECRET, "local"), layout=dst_layout)
    tx = KVSender({}, SenderConfig(SECRET), layout=src_layout)

    def landed() -> list[int]:
        time.sleep(0.3)  # the sender's worker thread moves what was queued
        return [layer for layer in range(3) if dst[layer][ticket.block_ids[0]].any()]

    try:
        ticket = rx.reserve("r", 10)
        tx.start(ticket, src, [2], 10)
        tx.push_layer("r", 0)
        assert landed() == []  # rank 1 may not have written layer 0 yet
        tx.push_layer("r", 1)
        assert landed() == [0]
        tx.push_layer("r", 2)
        assert landed() == [0, 1]
        tx.commit("r", 5)
        results = wait_results(tx, rx, count=2)
        assert [r.status for r in results] == ["DONE", "DONE"], [r.error for r in results]
        for layer in range(3):  # each decode head from the prefill rank that holds it
            assert torch.equal(dst[layer][ticket.block_ids[0]], torch.cat([src[0][layer][2], src[1][layer][2]], 2))
        pool.free(rx.release("r"))
    finally:
        tx.close()
        rx.close()
    assert pool.is_fully_free()


@pytest.mark.parametrize("transport", ["local", "grpc"])
def test_late_chunks_after_an_abort_touch_no_decode_rank(transport):
    """A decode replica at TP=2: once a transfer is aborted and its blocks reused, a late chunk for either
    rank's heads is dropped, and neither rank's cache changes."""
    from engine.block_pool import BlockPool
    from kvtransfer import transports
    from kvtransfer.planner import ChunkPlan
    from kvtransfer.slabs import rank_views

    dst_layout = KVLayout(2, 2, 8, 16, "float32", 2)
    dst = [[torch.zeros(6, 2, 16, 1, 8) for _ in range(2)] for _ in range(2)]
    src = rank_views([[torch.randn(6, 2, 16, 2, 8) for _ in range(2)]])  # a TP=1 sender: both heads
    pool = BlockPool(6)
    rx = KVReceiver(dst, pool, {"architecture": "llama"}, ReceiverConfig(SECRET, transport), layout=dst_layout)
    sender_fp = {"architecture": "llama", **KVLayout(2, 2, 8, 16, "float32").fingerprint_fields()}
    link = transports.connect(rx.endpoint, sender_fp, SenderConfig(SECRET))
    try:
        ticket = rx.reserve("old", 20)
        assert link.send_chunk(ticket.transfer_id, ChunkPlan(0, 0, 2, 1, 0, 1), src, [1, 2], False).result(10).ok
        assert dst[0][0][ticket.block_ids[0]].any() and not dst[1][0].any()  # head 0 went to rank 0 only
        rx.abort("old")
        assert [r.status for r in rx.poll()] == ["FAILED"]
        reused = rx.reserve("new", 20)
        assert set(reused.block_ids) == set(ticket.block_ids)
        before = [t.clone() for rank in dst for t in rank]
        late = [link.send_chunk(ticket.transfer_id, ChunkPlan(layer, 0, 2, 1, head, 1, 0, head), src, [1, 2], False)
                for layer in (0, 1) for head in (0, 1)]
        assert all(f.result(10).dropped for f in late)
        assert all(torch.equal(a, b) for a, b in zip(before, [t for rank in dst for t in rank]))
        rx.abort("new")
        rx.poll()
    finally:
        link.close()
        rx.close()
    assert pool.is_fully_free()
