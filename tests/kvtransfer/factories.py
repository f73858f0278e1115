"""Small builders shared by the transfer tests, and the peer processes they spawn.

Source KV contents are a pure function of (spec, seed), so a peer process
can rebuild what the other side must have received without shipping tensors.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import random
import time

import torch

from engine.block_pool import BlockPool
from engine.kv_cache import KVCacheSpec, allocate_kv_cache
from kvtransfer.config import ReceiverConfig, SenderConfig

SECRET = "test-cluster-secret"
NUM_BLOCKS = 512


def make_spec(dtype: str = "bfloat16", num_layers: int = 4) -> KVCacheSpec:
    return KVCacheSpec(num_layers=num_layers, num_kv_heads=2, head_dim=8, block_size=16, dtype=dtype)


def make_fingerprint(spec: KVCacheSpec, **overrides) -> dict[str, str]:
    fp = {"architecture": "llama", "num_layers": str(spec.num_layers), "num_kv_heads": str(spec.num_kv_heads),
          "head_dim": str(spec.head_dim), "block_size": str(spec.block_size), "dtype": spec.dtype,
          "tp_size": "1"}
    fp.update(overrides)
    return fp


def make_source(spec: KVCacheSpec, seed: int, num_blocks: int = NUM_BLOCKS) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    kv = allocate_kv_cache(spec, num_blocks)
    for layer in kv:
        layer.copy_(torch.randn(layer.shape, generator=g))
    return kv


def scattered(pool: BlockPool, n: int, rng: random.Random) -> list[int]:
    """Allocate n blocks in shuffled order (so runs are short and ids non-monotonic)."""
    ids = pool.allocate(n)
    rng.shuffle(ids)
    return ids


def wait_results(*endpoints, count: int, timeout_s: float = 30.0) -> list:
    """Poll sender/receiver objects until ``count`` results in all, or timeout."""
    out = []
    end = time.time() + timeout_s
    while len(out) < count and time.time() < end:
        for e in endpoints:
            out += e.poll()
        time.sleep(0.005)
    return out


def spawn(target, *args):
    """Start a peer process; returns once it is set up (it sent its first message, returned here)."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child, *args), daemon=True)
    proc.start()
    if not parent.poll(60):
        raise TimeoutError("peer process did not start")
    return proc, parent, parent.recv()


# ---- peer process bodies (run in a spawned child) --------------------------
def sender_peer(conn, dtype: str, seed: int, config: SenderConfig) -> None:
    """Receives ("send", tickets, tokens, stop_after_layer|None); answers results and pool state."""
    from kvtransfer import KVSender

    spec = make_spec(dtype)
    kv = make_source(spec, seed)
    pool = BlockPool(NUM_BLOCKS)
    sender = KVSender(make_fingerprint(spec), config)
    rng = random.Random(seed)
    conn.send(("ready",))
    while True:
        msg = conn.recv()
        if msg[0] == "exit":
            sender.close()
            return
        _, tickets, tokens, stop_after = msg
        src = {}
        try:
            for t, n in zip(tickets, tokens):
                src[t.request_id] = scattered(pool, len(t.block_ids), rng)
                sender.start(t, kv, src[t.request_id], n)
            for layer in range(spec.num_layers):  # layer-major, like a batched forward pass
                for t in tickets:
                    sender.push_layer(t.request_id, layer)
                if stop_after is not None and layer == stop_after:
                    conn.send(("stalled", src))
                    time.sleep(3600)  # the test kills us here
            for i, t in enumerate(tickets):
                sender.commit(t.request_id, 1000 + i)
        except Exception as e:
            conn.send(("error", repr(e)))
            continue
        results = wait_results(sender, count=len(tickets))
        for r in results:
            pool.free(src[r.request_id])
        conn.send(("results", results, src, pool.is_fully_free()))


def receiver_peer(conn, dtype: str, config: ReceiverConfig) -> None:
    """Hosts a receiver; answers ("reserve", rid, tokens, lease_s) with a Ticket; polls in between."""
    from kvtransfer import KVReceiver

    spec = make_spec(dtype)
    pool = BlockPool(NUM_BLOCKS)
    rx = KVReceiver(allocate_kv_cache(spec, NUM_BLOCKS), pool, make_fingerprint(spec), config)
    conn.send(rx.endpoint)
    while True:
        if conn.poll(0.01):
            msg = conn.recv()
            if msg[0] == "exit":
                rx.close()
                return
            conn.send(rx.reserve(msg[1], msg[2], msg[3]))
        rx.poll()


def kill(proc) -> None:
    os.kill(proc.pid, 9)
    proc.join(5)
