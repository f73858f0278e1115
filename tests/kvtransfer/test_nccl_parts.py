"""The nccl transport (gloo on CPU) sends a chunk of several layers as one message a layer under one
announce: a TP=2 prefill's half-size units, coalesced two layers to a chunk, go straight from the rank's
cache when their blocks are one run (no staging copy), and through a staging buffer otherwise (scattered
blocks, a head range of a rank's slabs); a chunk of thin layers goes as one message; either way every
layer lands in its own layer of the right decode blocks, bit for bit, checksummed or not."""
from __future__ import annotations

import pytest
import torch

from engine.block_pool import BlockPool
from kvtransfer import KVReceiver, transports
from kvtransfer.config import ReceiverConfig, SenderConfig
from kvtransfer.layout import KVLayout
from kvtransfer.planner import ChunkPlan
from kvtransfer.slabs import rank_views
from kvtransfer.transports import pairing

SECRET = "parts-secret"
LAYERS, BLOCKS = 3, 8


@pytest.fixture
def two_to_one():
    """A TP=1 decode receiver (2 KV heads) in this process and a link from a TP=2 prefill (a head a rank),
    each prefill layer of each rank filled with its own values."""
    dst = [torch.zeros(BLOCKS, 2, 16, 2, 8) for _ in range(LAYERS)]
    src = [[torch.randn(BLOCKS, 2, 16, 1, 8) + 10 * layer + 100 * rank for layer in range(LAYERS)] for rank in range(2)]
    pool = BlockPool(BLOCKS)
    rx = KVReceiver(dst, pool, {"architecture": "llama"}, ReceiverConfig(SECRET, "nccl"),
                    layout=KVLayout(LAYERS, 2, 8, 16, "float32", 1))
    fp = {"architecture": "llama", **KVLayout(LAYERS, 2, 8, 16, "float32", 2).fingerprint_fields()}
    link = transports.connect(rx.endpoint, fp, SenderConfig(SECRET))
    yield rx, link, src, dst
    link.close()
    rx.close()
    assert pool.is_fully_free()


def _send_both_ranks(link, ticket, src, src_ids, checksum: bool):
    """Every layer of both ranks' heads, as the sender coalesces them: one chunk of all layers per rank."""
    views = rank_views(src)
    chunks = [ChunkPlan(0, 0, len(src_ids), LAYERS, rank, 1, rank, 0) for rank in range(2)]
    return [link.send_chunk(ticket.transfer_id, c, views, src_ids, checksum) for c in chunks], chunks, views


@pytest.mark.parametrize("src_ids, is_view", [([2, 3, 4], True), ([5, 1, 3], False)])
@pytest.mark.parametrize("checksum", [False, True])
def test_each_layer_of_a_coalesced_chunk_lands_in_its_layer(two_to_one, monkeypatch, src_ids, is_view, checksum):
    rx, link, src, dst = two_to_one
    monkeypatch.setattr(pairing, "MIN_PART_BYTES", 1024)  # these 3 KiB layers count as large (both sides)
    ticket = rx.reserve("r", 16 * len(src_ids))
    sent, chunks, views = _send_both_ranks(link, ticket, src, src_ids, checksum)
    assert [f.result(10).ok for f in sent] == [True, True], [f.result().error for f in sent]
    for layer in range(LAYERS):
        for i, (s, d) in enumerate(zip(src_ids, ticket.block_ids)):
            want = torch.cat([src[0][layer][s], src[1][layer][s]], 2)  # decode head r from prefill rank r
            assert torch.equal(dst[layer][d], want), f"layer {layer}, block {i}"
    # one run of whole slabs goes from the cache as it lies: one view a layer, no staging buffer
    parts, staging = link._parts(views, chunks[0], src_ids)
    assert len(parts) == LAYERS and (staging is None) == is_view
    if is_view:
        assert [p.data_ptr() for p in parts] == [src[0][layer][src_ids[0]].data_ptr() for layer in range(LAYERS)]
    rx.abort("r")
    rx.poll()


def test_a_chunk_of_thin_layers_goes_as_one_message(two_to_one):
    """Below pairing.MIN_PART_BYTES a layer (a short prompt's) is not worth a message: the chunk is copied
    together and sent once, and still lands layer by layer."""
    rx, link, src, dst = two_to_one
    ticket = rx.reserve("r", 32)
    sent, chunks, views = _send_both_ranks(link, ticket, src, [2, 3], True)
    assert [f.result(10).ok for f in sent] == [True, True], [f.result().error for f in sent]
    parts, staging = link._parts(views, chunks[1], [2, 3])
    assert len(parts) == 1 and staging is not None
    for layer in range(LAYERS):
        for s, d in zip([2, 3], ticket.block_ids):
            assert torch.equal(dst[layer][d], torch.cat([src[0][layer][s], src[1][layer][s]], 2))
    rx.abort("r")
    rx.poll()


def test_a_head_range_of_a_ranks_slabs_is_staged_and_lands_right():
    """A TP=1 prefill (both heads) to a TP=2 decode: each decode rank's head is a strided range of the
    sender's slabs, gathered into staging, still one message a layer."""
    dst = [[torch.zeros(BLOCKS, 2, 16, 1, 8) for _ in range(LAYERS)] for _ in range(2)]
    src = [[torch.randn(BLOCKS, 2, 16, 2, 8) + 10 * layer for layer in range(LAYERS)]]
    pool = BlockPool(BLOCKS)
    rx = KVReceiver(dst, pool, {"architecture": "llama"}, ReceiverConfig(SECRET, "nccl"),
                    layout=KVLayout(LAYERS, 2, 8, 16, "float32", 2))
    fp = {"architecture": "llama", **KVLayout(LAYERS, 2, 8, 16, "float32", 1).fingerprint_fields()}
    link = transports.connect(rx.endpoint, fp, SenderConfig(SECRET))
    try:
        ticket = rx.reserve("r", 32)
        views = rank_views(src)
        chunks = [ChunkPlan(0, 0, 2, LAYERS, head, 1, 0, head) for head in range(2)]
        assert [link._parts(views, c, [3, 4])[1] is not None for c in chunks] == [True, True]
        sent = [link.send_chunk(ticket.transfer_id, c, views, [3, 4], True) for c in chunks]
        assert [f.result(10).ok for f in sent] == [True, True], [f.result().error for f in sent]
        for layer in range(LAYERS):
            for s, d in zip([3, 4], ticket.block_ids):
                for head in range(2):
                    assert torch.equal(dst[head][layer][d], src[0][layer][s][:, :, head:head + 1])
        rx.abort("r")
        rx.poll()
    finally:
        link.close()
        rx.close()
    assert pool.is_fully_free()
