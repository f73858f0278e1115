"""Transport threads racing the owner's aborts never write into blocks someone else now holds."""
from __future__ import annotations

import queue
import random
import threading
import time

import torch

from engine.block_pool import BlockPool, NoFreeBlocksError
from engine.kv_cache import allocate_kv_cache
from kvtransfer import KVReceiver, KVSender
from kvtransfer.config import ReceiverConfig, SenderConfig
from tests.kvtransfer.factories import SECRET, make_fingerprint, make_source, make_spec, wait_results


def test_racing_aborts_never_leak_writes_into_reused_blocks():
    spec = make_spec("float32", num_layers=2)
    num_blocks = 48
    pool = BlockPool(num_blocks)
    rx = KVReceiver(allocate_kv_cache(spec, num_blocks), pool, make_fingerprint(spec), ReceiverConfig(SECRET, "local"))
    core = rx.core
    work: queue.Queue = queue.Queue()
    stop = threading.Event()

    def transport_thread():  # writes each transfer's blocks with its own byte, twice, then commits
        while not stop.is_set():
            try:
                ticket, value = work.get(timeout=0.01)
            except queue.Empty:
                continue
            n = len(ticket.block_ids)
            data = torch.full((spec.num_layers * n * core.slab_bytes,), value, dtype=torch.uint8)
            for _ in range(2):
                core.write_chunk(ticket.transfer_id, 0, 0, n, data, None, spec.num_layers)
            core.commit(ticket.transfer_id, value)

    threads = [threading.Thread(target=transport_thread, daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    rng = random.Random(0)
    open_requests: list[str] = []
    num_done = num_failed = 0
    deadline = time.monotonic() + 60
    i = 0
    # at least 600 rounds, and on until both paths were seen (the transport
    # threads need the GIL to finish anything; a loaded machine starves them)
    while i < 600 or (min(num_done, num_failed) <= 5 and time.monotonic() < deadline):
        i += 1
        time.sleep(0.0005)
        try:
            ticket = rx.reserve(f"r{i}", rng.randint(1, 16 * 8))
            work.put((ticket, i % 251 + 1))
            open_requests.append(ticket.request_id)
        except NoFreeBlocksError:
            pass
        if open_requests and rng.random() < 0.4:
            rx.abort(open_requests.pop(rng.randrange(len(open_requests))))
        for r in rx.poll():
            if r.request_id in open_requests:
                open_requests.remove(r.request_id)
            if r.status == "DONE":
                num_done += 1
                for layer in core.kv_bytes[0]:  # only this transfer's byte, in every block and layer
                    assert bool((layer[r.block_ids] == r.first_token).all()), r.request_id
                pool.free(rx.release(r.request_id))
            else:
                num_failed += 1
    stop.set()
    for t in threads:
        t.join(5)
    for request_id in open_requests:
        rx.abort(request_id)
    rx.poll()
    rx.close()
    assert num_done > 5 and num_failed > 5  # both paths were exercised
    assert pool.is_fully_free()


def test_receiver_abort_fails_the_sender():
    spec = make_spec()
    rx = KVReceiver(allocate_kv_cache(spec, 16), BlockPool(16), make_fingerprint(spec), ReceiverConfig(SECRET, "grpc"))
    src_pool = BlockPool(16)
    src = src_pool.allocate(2)
    tx = KVSender(make_fingerprint(spec), SenderConfig(SECRET))
    ticket = rx.reserve("r", 20)
    rx.abort("r")
    tx.start(ticket, make_source(spec, 1, num_blocks=16), src, 20)
    tx.push_layer("r", 0)
    [sent] = wait_results(tx, count=1)
    assert sent.status == "FAILED" and "unknown, finished, aborted or expired" in sent.error
    assert [r.status for r in rx.poll()] == ["FAILED"]
    src_pool.free(src)
    tx.close()
    rx.close()
    assert rx.pool.is_fully_free() and src_pool.is_fully_free()
