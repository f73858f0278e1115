"""Benchmark of heterogeneous tensor-parallel KV transfer (not a timed test).

    python -m kvtransfer.bench_tp [--sizes 1024,4096] [--transports grpc,nccl] [--reps 5] [--write]

1. The copy a KV-head range costs in the engine's heads-inner layout
   (``[blocks, 2, block_size, heads, head_dim]``: a head range of a block is
   ``2 * block_size`` strided runs) against the whole-block contiguous copy, and
   against the same head range in a heads-outer layout (``[blocks, 2, heads,
   block_size, head_dim]``: 2 runs per block), for gather (sender) and scatter
   (receiver).
2. Transfers between a KVSender here and a KVReceiver in a second process on
   loopback, prefill TP -> decode TP in 1->1, 2->1, 1->2 and 2->2, each
   replica's ranks' caches as separate tensors (as rank 0 maps them), all
   interleaved round by round, so the heterogeneous throughput is read
   against the homogeneous one of the same round.

The KV is SmolLM2-135M's geometry (30 layers, head_dim 64, block 16, bf16)
with 4 KV heads, so that TP=2 splits them: 32,768 bytes per token.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time

import numpy as np
import torch

from engine.block_pool import BlockPool
from engine.kv_cache import KVCacheSpec, allocate_kv_cache
from kvtransfer import slabs
from kvtransfer.config import ReceiverConfig, SenderConfig
from kvtransfer.layout import KVLayout
from kvtransfer.bench import serve_receiver

LAYOUTS = {tp: KVLayout(30, 4, 64, 16, "bfloat16", tp) for tp in (1, 2)}
FINGERPRINT = {"architecture": "llama", "hidden_size": "576", "vocab_size": "49152"}
SECRET = "bench-secret"
PAIRS = [(1, 1), (2, 1), (1, 2), (2, 2)]
TARGET = 80.0  # % of the homogeneous throughput (issue #12)
MAX_CHUNK = 4 << 20  # SenderConfig.max_chunk_bytes (its default)


def rank_caches(layout: KVLayout, num_blocks: int, fill: bool = False) -> list[list[torch.Tensor]]:
    """rank -> local layer -> cache: each rank its layers (all of them below pipeline parallelism) and heads."""
    out = []
    for rank in range(layout.num_ranks):
        spec = KVCacheSpec(len(layout.layers_of(rank)), len(layout.heads_of(rank)), layout.head_dim,
                           layout.block_size, layout.dtype)
        kv = allocate_kv_cache(spec, num_blocks)
        if fill:
            for layer in kv:
                layer.copy_(torch.randn(layer.shape))
        out.append(kv)
    return out


def bytes_for(num_tokens: int) -> int:
    lay = LAYOUTS[1]
    return -(-num_tokens // lay.block_size) * lay.num_layers * lay.slab_bytes(0)


# ---- 1. the strided copy ------------------------------------------------------
def _best(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def copy_costs(num_tokens: int, reps: int) -> list[tuple[str, int, float]]:
    """(what, bytes moved, seconds) for one layer of a `num_tokens` prompt, scattered block ids."""
    lay = LAYOUTS[1]
    n = -(-num_tokens // lay.block_size)
    nb = 2 * n + 8
    ids = list(range(0, 2 * n, 2))  # every other block: no two consecutive, the worst case for runs
    inner = torch.randn(nb, 2, lay.block_size, lay.num_kv_heads, lay.head_dim).to(torch.bfloat16)
    outer = torch.randn(nb, 2, lay.num_kv_heads, lay.block_size, lay.head_dim).to(torch.bfloat16)
    hv, slab = slabs.head_views([inner]), slabs.byte_views([inner])
    half = lay.num_kv_heads // 2
    whole_bytes, half_bytes = n * lay.slab_bytes(0), n * lay.slab_bytes(0) // 2
    out_whole = torch.empty(whole_bytes, dtype=torch.uint8)
    out_half = torch.empty(half_bytes, dtype=torch.uint8)
    o_outer = out_half.view(torch.bfloat16).view(n, 2, half, lay.block_size, lay.head_dim)

    o_np, outer_np, ids_np = o_outer.view(torch.int16).numpy(), outer.view(torch.int16).numpy(), np.asarray(ids)

    def outer_gather():  # heads-outer: the head range is 2 contiguous runs per block; the same numpy fancy index
        o_np[...] = outer_np[ids_np, :, :half]

    src_half = out_half.view(n, 2 * lay.block_size, half, -1)
    rows = [
        ("gather, whole blocks (contiguous slabs)", whole_bytes,
         _best(lambda: slabs.gather(slab, range(0, 1), ids, out_whole), reps)),
        ("gather, half the heads, heads-inner (strided)", half_bytes,
         _best(lambda: slabs.gather_heads(hv, range(0, 1), ids, 0, half, out_half), reps)),
        ("gather, half the heads, heads-outer (2 runs per block)", half_bytes, _best(outer_gather, reps)),
        ("scatter, whole blocks (contiguous slabs)", whole_bytes,
         _best(lambda: slabs.scatter(slab[0], ids, out_whole.view(n, -1)), reps)),
        ("scatter, half the heads, heads-inner (strided)", half_bytes,
         _best(lambda: slabs.scatter_heads(hv[0], ids, half, src_half), reps)),
    ]
    return rows


# ---- 2. transfers ---------------------------------------------------------------
def receiver_main(conn, transport: str, tp: int, num_blocks: int) -> None:
    from kvtransfer import KVReceiver

    layout = LAYOUTS[tp]
    pool = BlockPool(num_blocks)
    serve_receiver(conn, KVReceiver(rank_caches(layout, num_blocks), pool, FINGERPRINT,
                                    ReceiverConfig(SECRET, transport, max_workers=64), layout=layout), pool)


class Pair:
    """A KVSender (prefill layout `src`, its ranks' caches `src_kv` here) and a KVReceiver (decode TP=b) in
    another process."""

    def __init__(self, transport: str, src: KVLayout, b: int, num_blocks: int, src_kv: list[list[torch.Tensor]]):
        from kvtransfer import KVSender

        self.src_kv = src_kv
        self.src_pool = BlockPool(num_blocks)
        config = SenderConfig(SECRET, deadline_s=120, max_chunk_bytes=MAX_CHUNK)
        self.sender = KVSender(FINGERPRINT, config, layout=src)
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=receiver_main, args=(child, transport, b, num_blocks), daemon=True)
        self.proc.start()
        self.endpoint = self.conn.recv()
        self.sender.connect(self.endpoint)
        self._count = 0

    def transfer(self, tokens: int) -> float:
        self._count += 1
        rid = f"b{self._count}"
        self.conn.send(("reserve", rid, tokens))
        ticket = self.conn.recv()
        src = self.src_pool.allocate(len(ticket.block_ids))
        t0 = time.time()
        self.sender.start(ticket, self.src_kv, src, tokens)
        hook = self.sender.hook(rid)
        for layer in range(LAYOUTS[1].num_layers):
            hook(layer)
        self.sender.commit(rid, 1)
        while True:
            done = self.sender.poll()
            if done:
                break
            time.sleep(0.0005)
        if done[0].status != "DONE":
            raise RuntimeError(f"transfer failed: {done[0].error}")
        self.src_pool.free(src)
        return done[0].finished_at - t0

    def close(self) -> bool:
        self.sender.close()
        self.conn.send(("exit",))
        ok = self.conn.recv()
        self.proc.join(10)
        return ok and self.src_pool.is_fully_free()


def section(args, copies, seconds, ratios, command: str) -> str:
    from engine.benchmarks_md import provenance

    lines = [
        "## Heterogeneous TP KV transfer", "",
        "Command (from the repository root, in the project's virtual environment):", "",
        "```", command, "```", "",
        "The KV of SmolLM2-135M's geometry with 4 KV heads (bf16, 30 layers, head_dim 64, block 16: 32,768",
        "bytes per token), every rank's cache a tensor of its own, as rank 0 maps them. A KV-head range of a",
        "block in the engine's heads-inner layout is 32 strided runs of `heads x 128` bytes.", "",
        f"### The strided copy (one layer, {args.copy_tokens} tokens, every other block id: no runs; best of"
        f" {args.reps})", "",
        "| copy | MB | ms | GB/s |", "|---|---:|---:|---:|"]
    for what, nbytes, sec in copies:
        lines.append(f"| {what} | {nbytes / 1e6:.2f} | {sec * 1e3:.3f} | {nbytes / sec / 1e9:.2f} |")
    lines += ["", f"### Transfers, prefill TP -> decode TP (median of {args.reps}, interleaved)", "",
              "The ratio is the pair's throughput over the homogeneous 1 -> 1 of the same transport, prompt and",
              "round; the spread is the lowest and highest per-round ratio.", "",
              "| transport | tokens | MB | TP | ms | GB/s | % of 1 -> 1 | per-round spread |",
              "|---|---:|---:|---|---:|---:|---:|---:|"]
    worst = {}
    for (transport, tokens, a, b), sec in seconds.items():
        nbytes = bytes_for(tokens)
        r = ratios[transport, tokens, a, b]
        pct = 100 * seconds[transport, tokens, 1, 1] / sec
        if a != b:
            worst[transport, tokens] = min(worst.get((transport, tokens), 1e9), pct)
        lines.append(f"| {transport} | {tokens} | {nbytes / 1e6:.1f} | {a} -> {b} | {sec * 1e3:.1f} | "
                     f"{nbytes / sec / 1e9:.2f} | {pct:.0f}% | {min(r):.0f}–{max(r):.0f}% |")
    lines += ["", "| target (issue #12) | this run |", "|---|---|"]
    for (transport, tokens), pct in worst.items():
        lines.append(f"| heterogeneous >= {TARGET:.0f}% of homogeneous, {transport}, {tokens} tokens | "
                     f"**{'met' if pct >= TARGET else 'not met'}**: worst pair {pct:.0f}% |")
    start = getattr(args, "load_at_start", None)
    lines += ["", provenance() + (f" (load average {start:.1f} when it started)" if start is not None else ""), ""]
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m kvtransfer.bench_tp", description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="1024,4096")
    ap.add_argument("--transports", default="grpc,nccl")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--copy-tokens", type=int, default=4096)
    ap.add_argument("--write", action="store_true", help="replace the section of BENCHMARKS.md")
    args = ap.parse_args(argv)
    args.load_at_start = os.getloadavg()[0]  # the machine is shared: say how busy it was
    sizes = [int(s) for s in args.sizes.split(",")]
    transports = [t for t in args.transports.split(",") if t]
    num_blocks = -(-max(sizes) // LAYOUTS[1].block_size) + 8

    copies = copy_costs(args.copy_tokens, max(args.reps, 5))
    for what, nbytes, sec in copies:
        print(f"{what}: {nbytes / sec / 1e9:.2f} GB/s")
    sources = {tp: rank_caches(LAYOUTS[tp], num_blocks, fill=True) for tp in (1, 2)}
    pairs = {(t, a, b): Pair(t, LAYOUTS[a], b, num_blocks, sources[a]) for t in transports for a, b in PAIRS}
    for pair in pairs.values():
        pair.transfer(max(sizes))  # warm-up: connections, and every receiver block written once
    seconds, ratios = {}, {}
    for tokens in sizes:
        runs = {key: [] for key in pairs}
        for _ in range(args.reps):
            for key, pair in pairs.items():
                runs[key].append(pair.transfer(tokens))
        for (t, a, b), r in runs.items():
            seconds[t, tokens, a, b] = statistics.median(r)
            ratios[t, tokens, a, b] = [100 * h / x for h, x in zip(runs[t, 1, 1], r)]
        print(tokens, {k: f"{v * 1e3:.1f}" for k, v in seconds.items() if k[1] == tokens})
    for key, pair in pairs.items():
        assert pair.close(), f"{key}: block pools not fully free after the benchmark"
    command = "python -m kvtransfer.bench_tp " + " ".join(sys.argv[1:] if argv is None else argv)
    text = section(args, copies, seconds, ratios, command.strip())
    print(text)
    if args.write:
        from engine.benchmarks_md import write_section

        write_section(text)


if __name__ == "__main__":
    main()
