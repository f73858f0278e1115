"""Served time per output token, one colocated replica at TP=1 against TP=2, side by side.

    python -m cluster.bench.tp [--dtype auto] [--rounds 2] [--write]

The same CPUs either way: TP=1 is one replica of num_cpus 2 (2 torch threads), TP=2 one
replica of two ranks of num_cpus 1 (1 thread each, two Ray actors in a STRICT_PACK placement
group, shared-memory all-reduce). Each cluster is `kvrelay serve` in a process of its own
with its own local Ray (`cluster.bench.overhead`); the rounds alternate TP=1 and TP=2 so a
change in the machine's load hits both. The model is a random checkpoint of SmolLM2-135M's
shape with 8 heads (`engine.parallel.bench.make_smol_shaped_checkpoint`: SmolLM2's 9 heads do
not split 2 ways) and the default model's tokenizer. Per run: one stream's inter-token gaps
(median over runs of each request's mean gap), then 4 concurrent streams' mean gap.
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from cluster.bench.overhead import _Served, _stream_times

SECTION = "## Tensor parallelism, served"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def model_folder(root: Path) -> Path:
    from engine.parallel.bench import make_smol_shaped_checkpoint
    from engine.weights import resolve_model

    folder = make_smol_shaped_checkpoint(root / "smol-shaped-8-heads")
    default = resolve_model(None)
    for name in TOKENIZER_FILES:
        if (default / name).is_file():
            shutil.copy(default / name, folder / name)
    return folder


def spec(model: Path, tp: int, dtype: str) -> dict:
    return {"model": str(model), "dtype": dtype, "mode": "colocated",
            "frontend": {"host": "127.0.0.1", "grpc_port": 0, "http_port": 0},
            "colocated": {"replicas": 1, "tensor_parallel_size": tp, "resources": {"num_cpus": 2 // tp},
                          "num_kv_blocks": 512, "enable_prefix_caching": False}}


def measure(model: Path, tp: int, dtype: str, prompt_len: int, max_tokens: int, runs: int, concurrent: int) -> dict:
    from cluster.client import KVRelayClient

    served = _Served(spec(model, tp, dtype))
    try:
        client = KVRelayClient(served.target, timeout=600)
        prompt = [(7 * i) % 40000 + 100 for i in range(prompt_len)]
        kw = dict(token_ids=prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True)
        list(client.stream(**kw))  # warm-up
        single = [_stream_times(client.stream(**kw)) for _ in range(runs)]

        def one(i):
            return _stream_times(client.stream(**dict(kw, token_ids=[t + i for t in prompt])))
        with ThreadPoolExecutor(concurrent) as pool:
            many = list(pool.map(one, range(concurrent)))
        client.close()
        return {"ttft_ms": statistics.median(r[0] for r in single) * 1000,
                "tpot_ms": statistics.median(statistics.mean(r[1]) for r in single) * 1000,
                "tpot_many_ms": statistics.mean(statistics.mean(r[1]) for r in many) * 1000}
    finally:
        served.close()


def _cpu_line() -> str:
    name, flags = "?", set()
    for line in open("/proc/cpuinfo"):
        key, _, value = line.partition(":")
        if key.strip() == "model name" and name == "?":
            name = value.strip()
        elif key.strip() == "flags":
            flags = set(value.split())
            break
    return f"{name}, flags {' '.join(f for f in ('avx512_bf16', 'avx2') if f in flags) or 'neither avx512_bf16 nor avx2'}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--concurrent", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2, help="TP=1 then TP=2, this many times")
    ap.add_argument("--write", action="store_true", help=f"replace '{SECTION}' in BENCHMARKS.md")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as root:
        model = model_folder(Path(root))
        results: dict[int, list[dict]] = {1: [], 2: []}
        t0 = time.monotonic()
        for r in range(args.rounds):
            for tp in (1, 2):
                res = measure(model, tp, args.dtype, args.prompt_len, args.max_tokens, args.runs, args.concurrent)
                print(f"round {r + 1} TP={tp}: {res}", flush=True)
                results[tp].append(res)
        wall = time.monotonic() - t0
    med = {tp: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for tp, rs in results.items()}
    rows = [("TTFT, one request (ms)", "ttft_ms"), ("TPOT, one stream (ms/token)", "tpot_ms"),
            (f"TPOT, {args.concurrent} concurrent streams (ms/token)", "tpot_many_ms")]
    table = ["| metric | TP=1 (2 threads) | TP=2 (1 thread per rank) | TP=2 / TP=1 |", "|---|---|---|---|"]
    for label, key in rows:
        a, b = med[1][key], med[2][key]
        table.append(f"| {label} | {a:.2f} | {b:.2f} | {b / a:.2f}x |")
    per_round = ["| round | TP=1 TPOT (ms) | TP=2 TPOT (ms) | ratio |", "|---|---|---|---|"]
    for i, (a, b) in enumerate(zip(results[1], results[2]), start=1):
        per_round.append(f"| {i} | {a['tpot_ms']:.2f} | {b['tpot_ms']:.2f} | {b['tpot_ms'] / a['tpot_ms']:.2f}x |")
    text = "\n".join(table) + "\n\nEach round's single-stream TPOT:\n\n" + "\n".join(per_round)
    print(text)
    if args.write:
        import os

        from engine.benchmarks_md import provenance, write_section

        load = os.getloadavg()
        cmd = "python -m cluster.bench.tp " + " ".join(sys.argv[1:] if argv is None else argv)
        body = (f"{SECTION}\n\nOne colocated replica served by `kvrelay serve` (its own process and local Ray; "
                "this process is only the gRPC client), TP=1 against TP=2 on the same two CPUs: TP=1 is one "
                "replica of num_cpus 2 (2 torch threads), TP=2 one replica of two ranks of num_cpus 1 (1 thread "
                "each; two Ray actors in a STRICT_PACK placement group, shared-memory all-reduce). The model is a "
                "random checkpoint of SmolLM2-135M's shape with 8 heads of 72 (9 heads do not split 2 ways) and "
                "the default model's tokenizer. TPOT: the median over runs of one request's mean inter-token gap; "
                f"then {args.concurrent} concurrent streams' mean gap.\n\n"
                f"Prompt {args.prompt_len} tokens, {args.max_tokens} new tokens, greedy, dtype {args.dtype}; "
                f"medians over {args.rounds} alternating rounds ({wall:.0f} s in all).\n\n{text}\n\n"
                f"{provenance(cmd)}\n- CPU: {_cpu_line()}\n- Load average when it ended: {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} "
                "(1/5/15 min; the machine's 2 cores were shared with other work, so the absolute figures are "
                "noisy; the ratio is what the alternating rounds are for)\n")
        write_section(body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
