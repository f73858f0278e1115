"""Benchmark of the KV hand-off from a pipeline-parallel prefill (not a timed test).

    python -m kvtransfer.bench_pp [--sizes 1024,4096] [--transports grpc,nccl] [--reps 5] [--layer-ms 1] [--write]

A KVSender here with a prefill layout of PP=2 (and PP=2 x TP=2), every rank's
cache a tensor of its own holding only its layers, and a KVReceiver at decode
TP=1 or TP=2 in a second process on loopback. The per-layer hook is called
as a pipeline would: stage by stage, each layer after ``--layer-ms`` per 1024
tokens of simulated compute (a sleep: the cores stay with the transfer). For
each prefill rank the figure is the time from the hook of its last layer to
the acknowledgement of its last chunk (the receiver acknowledges a chunk once
it is written into every decode rank's cache), and the time from the end of
the forward pass (the last hook) to that: negative when a rank's KV landed
while the later stages were still computing. PP=1 (TP=1 -> TP=1) under the
same hooks is the reference; all pairs are interleaved round by round.

The KV is SmolLM2-135M's geometry with 4 KV heads (bench_tp's: bf16, 30
layers, head_dim 64, block 16, 32,768 bytes per token), split 15 + 15.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

from kvtransfer.bench_tp import LAYOUTS, Pair, bytes_for, rank_caches
from kvtransfer.layout import KVLayout

PREFILL = {(pp, tp): KVLayout(30, 4, 64, 16, "bfloat16", tp, pp_size=pp) for pp, tp in ((1, 1), (2, 1), (2, 2))}
PAIRS = [((1, 1), 1), ((2, 1), 1), ((2, 1), 2), ((2, 2), 1), ((2, 2), 2)]  # (prefill pp, tp), decode tp


class TimedPair(Pair):
    """A Pair whose link notes when each chunk was acknowledged, by the prefill rank it was read from."""

    def __init__(self, transport: str, src: KVLayout, b: int, num_blocks: int, src_kv):
        super().__init__(transport, src, b, num_blocks, src_kv)
        self.layout = src
        self.acked: dict[int, float] = {}
        link = self.sender._links[self.endpoint]  # the link connect() opened
        send = link.send_chunk

        def timed(transfer_id, chunk, *rest):
            future = send(transfer_id, chunk, *rest)
            future.add_done_callback(lambda _, r=chunk.src_rank: self._ack(r))
            return future

        link.send_chunk = timed

    def _ack(self, rank: int) -> None:
        self.acked[rank] = max(self.acked.get(rank, 0.0), time.perf_counter())

    def transfer(self, tokens: int, layer_s: float) -> tuple[list[float], list[float], float]:
        """Per prefill rank: seconds from its last layer's hook to its last chunk acknowledged, and from the
        forward's end (the last hook) to it; and seconds from the forward's end to DONE."""
        self._count += 1
        rid = f"p{self._count}"
        self.conn.send(("reserve", rid, tokens))
        ticket = self.conn.recv()
        src = self.src_pool.allocate(len(ticket.block_ids))
        self.acked = {}
        self.sender.start(ticket, self.src_kv, src, tokens)
        hook = self.sender.hook(rid)
        lay = self.layout
        last_hook = [0.0] * lay.num_ranks
        for stage in range(lay.pp_size):
            for layer in lay.layers_of(stage * lay.tp_size):
                time.sleep(layer_s)
                hook(layer)
            for rank in range(stage * lay.tp_size, (stage + 1) * lay.tp_size):
                last_hook[rank] = time.perf_counter()
        end = time.perf_counter()
        self.sender.commit(rid, 1)
        while not (done := self.sender.poll()):
            time.sleep(0.0005)
        if done[0].status != "DONE":
            raise RuntimeError(f"transfer failed: {done[0].error}")
        finished = time.perf_counter()
        self.src_pool.free(src)
        return ([self.acked[r] - last_hook[r] for r in range(lay.num_ranks)],
                [self.acked[r] - end for r in range(lay.num_ranks)], finished - end)


def _name(pp: int, tp: int) -> str:
    return f"PP={pp}" + (f" x TP={tp}" if tp > 1 else "") if pp > 1 else f"TP={tp}"


def section(args, results: dict, command: str) -> str:
    from engine.benchmarks_md import provenance

    lines = [
        "## Pipeline-parallel KV hand-off", "",
        "Command (from the repository root, in the project's virtual environment):", "",
        "```", command, "```", "",
        "A KVSender with a pipeline-parallel prefill layout (each rank's cache holds only its layers, split",
        "15 + 15 of SmolLM2-135M's 30, 4 KV heads, bf16: 32,768 bytes per token) into a KVReceiver in a",
        "second process on loopback. The hooks fire stage by stage, each layer after",
        f"{args.layer_ms:g} ms of simulated compute per 1024 tokens (a sleep). Per prefill rank: from the hook",
        "of its last layer to its last chunk acknowledged (written into every decode rank), and from the end",
        "of the forward pass (the last hook) to it: negative means that rank's KV had landed while the later",
        "stage was still computing. At TP=2 a layer is sent once the next layer's hook ran (the other tp",
        "rank may still write it before that), so a stage's last layer waits for the next stage's first",
        f"hook. Medians of {args.reps}, all pairs interleaved round by round; `done` is the forward's end to",
        "the transfer DONE on the sender.", "",
        "| transport | tokens | MB | prefill -> decode | per rank: last layer -> landed, ms | "
        "per rank: forward's end -> landed, ms | forward's end -> DONE, ms |",
        "|---|---:|---:|---|---|---|---:|"]
    for (transport, tokens, (pp, tp), b), (per_rank, after_end, done) in results.items():
        lines.append(f"| {transport} | {tokens} | {bytes_for(tokens) / 1e6:.1f} | {_name(pp, tp)} -> TP={b} | "
                     + " / ".join(f"{x * 1e3:.1f}" for x in per_rank) + " | "
                     + " / ".join(f"{x * 1e3:+.1f}" for x in after_end) + f" | {done * 1e3:.1f} |")
    lines += ["", provenance(), ""]
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m kvtransfer.bench_pp", description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="1024,4096")
    ap.add_argument("--transports", default="grpc,nccl")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--layer-ms", type=float, default=1.0, help="simulated compute per layer per 1024 tokens")
    ap.add_argument("--write", action="store_true", help="replace the section of BENCHMARKS.md")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    transports = [t for t in args.transports.split(",") if t]
    num_blocks = -(-max(sizes) // LAYOUTS[1].block_size) + 8
    sources = {key: rank_caches(lay, num_blocks, fill=True) for key, lay in PREFILL.items()}
    pairs = {(t, a, b): TimedPair(t, PREFILL[a], b, num_blocks, sources[a]) for t in transports for a, b in PAIRS}
    for pair in pairs.values():
        pair.transfer(max(sizes), 0.0)  # warm-up: connections, and every receiver block written once
    results = {}
    for tokens in sizes:
        layer_s = args.layer_ms / 1e3 * tokens / 1024
        runs = {key: [] for key in pairs}
        for _ in range(args.reps):
            for key, pair in pairs.items():
                runs[key].append(pair.transfer(tokens, layer_s))
        for (t, a, b), r in runs.items():
            ranks = range(len(r[0][0]))
            results[t, tokens, a, b] = ([statistics.median(x[0][i] for x in r) for i in ranks],
                                        [statistics.median(x[1][i] for x in r) for i in ranks],
                                        statistics.median(x[2] for x in r))
            print(t, tokens, a, b, results[t, tokens, a, b], flush=True)
    for key, pair in pairs.items():
        assert pair.close(), f"{key}: block pools not fully free after the benchmark"
    command = "python -m kvtransfer.bench_pp " + " ".join(sys.argv[1:] if argv is None else argv)
    text = section(args, results, command.strip())
    print(text)
    if args.write:
        from engine.benchmarks_md import write_section

        write_section(text)


if __name__ == "__main__":
    main()
