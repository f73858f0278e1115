"""Received blocks equal the sent ones bit for bit, for every transport."""
from __future__ import annotations

import random
import time

import pytest
import torch

from engine.block_pool import BlockPool
from engine.kv_cache import allocate_kv_cache
from kvtransfer import KVReceiver, KVSender
from kvtransfer.config import ReceiverConfig, SenderConfig
from tests.kvtransfer.factories import (NUM_BLOCKS, SECRET, make_fingerprint, make_source, make_spec, scattered,
                                        sender_peer, spawn, wait_results)


def shuffle_free_list(pool: BlockPool, rng: random.Random) -> None:
    """So that reserve() hands out scattered, non-monotonic block ids."""
    ids = pool.allocate(pool.num_blocks)
    rng.shuffle(ids)
    pool.free(ids)


def assert_blocks_equal(dst_kv, dst_ids, src_kv, src_ids) -> None:
    for layer, (d, s) in enumerate(zip(dst_kv, src_kv)):
        got, want = d[dst_ids].view(torch.uint8), s[src_ids].view(torch.uint8)
        assert torch.equal(got, want), f"layer {layer} differs"


def rounds(rng: random.Random):
    """(num_requests, tokens per request): partial last blocks, 1 to 64 in flight."""
    yield 1, [rng.randint(1, 200)]
    yield 64, [rng.randint(1, 100) for _ in range(64)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("transport", ["grpc", "nccl"])
def test_two_processes_bit_exact(transport, dtype):
    seed, rng = 7, random.Random(7)
    spec = make_spec(dtype)
    pool = BlockPool(NUM_BLOCKS)
    shuffle_free_list(pool, rng)
    kv = allocate_kv_cache(spec, NUM_BLOCKS)
    rx = KVReceiver(kv, pool, make_fingerprint(spec), ReceiverConfig(SECRET, transport))
    config = SenderConfig(SECRET, max_chunk_bytes=4096)  # several chunks per layer
    proc, conn, _ = spawn(sender_peer, dtype, seed, config)
    try:
        expected = make_source(spec, seed)
        for num_requests, tokens in rounds(rng):
            tickets = [rx.reserve(f"r{num_requests}-{i}", n) for i, n in enumerate(tokens)]
            conn.send(("send", tickets, tokens, None))
            received = {r.request_id: r for r in wait_results(rx, count=num_requests)}
            kind, sent, src_ids, sender_pool_free = conn.recv()
            assert kind == "results"
            assert sender_pool_free
            assert sorted(r.status for r in sent) == ["DONE"] * num_requests, [r.error for r in sent]
            for i, t in enumerate(tickets):
                r = received[t.request_id]
                assert (r.status, r.first_token, r.block_ids) == ("DONE", 1000 + i, t.block_ids), r.error
                assert_blocks_equal(kv, t.block_ids, expected, src_ids[t.request_id])
                pool.free(rx.release(t.request_id))
        conn.send(("exit",))
    finally:
        proc.join(10)
        rx.close()
    assert pool.is_fully_free()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_local_bit_exact(dtype):
    rng = random.Random(3)
    spec = make_spec(dtype)
    src_kv, dst_kv = make_source(spec, 3), allocate_kv_cache(spec, NUM_BLOCKS)
    src_pool, dst_pool = BlockPool(NUM_BLOCKS), BlockPool(NUM_BLOCKS)
    shuffle_free_list(dst_pool, rng)
    rx = KVReceiver(dst_kv, dst_pool, make_fingerprint(spec), ReceiverConfig(SECRET, "local"))
    tx = KVSender(make_fingerprint(spec), SenderConfig(SECRET, checksum=True, max_chunk_bytes=2048))
    for num_requests, tokens in rounds(rng):
        tickets = [rx.reserve(f"r{num_requests}-{i}", n) for i, n in enumerate(tokens)]
        src = {t.request_id: scattered(src_pool, len(t.block_ids), rng) for t in tickets}
        for t, n in zip(tickets, tokens):
            tx.start(t, src_kv, src[t.request_id], n)
        hook = tx.hook(*(t.request_id for t in tickets))  # what the engine's forward pass calls
        for layer in range(spec.num_layers - 1):
            hook(layer)
        before_last = time.time()
        hook(spec.num_layers - 1)
        for i, t in enumerate(tickets):
            tx.commit(t.request_id, i)
        results = wait_results(tx, rx, count=2 * num_requests)
        assert [r.status for r in results] == ["DONE"] * 2 * num_requests, [r.error for r in results]
        # both sides say when each became DONE: not before its last layer was pushed, not after poll()
        assert all(before_last <= r.finished_at <= time.time() for r in results), results
        for t in tickets:
            assert_blocks_equal(dst_kv, t.block_ids, src_kv, src[t.request_id])
            dst_pool.free(rx.release(t.request_id))
            src_pool.free(src[t.request_id])
    tx.close()
    rx.close()
    assert src_pool.is_fully_free() and dst_pool.is_fully_free()
