"""Disaggregated vs colocated on the same CPUs and the same workload.

    python -m cluster.bench.modes [--rates 0.5,1,1.5] [--write]

The workload mixes long prompts (which stall every decode step that shares
their worker) with short chat-like requests that decode steadily; this is
the interference disaggregation exists to remove. Each mode gets the same
budget: two replicas of one CPU each (colocated: 2 x both phases;
disaggregated: 1 prefill + 1 decode). `kvrelay bench` drives each cluster
over gRPC from a separate process, with a sweep of Poisson rates; results,
plots and a side-by-side table land in --out, and with --write in
BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from pathlib import Path

WORDS = ("river mountain cloud signal engine garden window silver market letter bridge winter "
         "harbor candle forest planet marble shadow lantern meadow ocean thunder violet").split()


def write_dataset(path: Path, n: int, long_frac: float, long_words: int, seed: int) -> None:
    rng = random.Random(seed)
    with path.open("w") as f:
        for i in range(n):
            if rng.random() < long_frac:
                prompt = "Summarize this log: " + " ".join(rng.choice(WORDS) for _ in range(long_words))
                out = 8
            else:
                prompt = f"Request {i}: write a short story about a {rng.choice(WORDS)}."
                out = 96
            f.write(json.dumps({"prompt": prompt, "output_len": out}) + "\n")


def run_mode(spec: dict, label: str, dataset: Path, out: Path, args) -> dict:
    from cluster.bench.overhead import _Served

    served = _Served(spec)
    try:
        cmd = [sys.executable, "-m", "cluster", "bench", "--target", served.target, "--dataset", str(dataset),
               "--rates", args.rates, "--num-prompts", str(args.num_prompts), "--warmup", "2",
               "--slo-ttft-ms", str(args.slo_ttft_ms), "--slo-tpot-ms", str(args.slo_tpot_ms),
               "--duration-s", str(args.duration_s), "--label", label, "--out", str(out / label), "--quiet"]
        subprocess.run(cmd, check=True)
        return json.loads((out / label / "results.json").read_text())
    finally:
        served.close()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", default="0.5,1,1.5")
    ap.add_argument("--num-prompts", type=int, default=30)
    ap.add_argument("--long-frac", type=float, default=0.3)
    ap.add_argument("--long-words", type=int, default=700)
    ap.add_argument("--slo-ttft-ms", type=float, default=3000)
    ap.add_argument("--slo-tpot-ms", type=float, default=60)
    ap.add_argument("--duration-s", type=float, default=120)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", type=Path, default=Path("bench_out/modes"))
    ap.add_argument("--write", action="store_true", help="replace '## Disaggregated vs colocated' in BENCHMARKS.md")
    args = ap.parse_args(argv)

    import ray

    from cluster.bench.report import compare_results

    args.out.mkdir(parents=True, exist_ok=True)
    dataset = args.out / "workload.jsonl"
    write_dataset(dataset, 400, args.long_frac, args.long_words, seed=0)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    one = {"num_cpus": 1}
    base = {"dtype": args.dtype, "frontend": {"grpc_port": 0, "http_port": 0},
            "router": {"policy": "least_loaded", "max_queue": 1024, "queue_timeout_s": 300}}
    col = dict(base, mode="colocated",
               colocated={"replicas": 2, "resources": one, "num_kv_blocks": 1024, "max_num_batched_tokens": 2048})
    dis = dict(base, mode="disaggregated", transfer={"backend": "grpc"},
               prefill={"replicas": 1, "resources": one, "num_kv_blocks": 512, "max_num_batched_tokens": 2048},
               decode={"replicas": 1, "resources": one, "num_kv_blocks": 1024})
    a = run_mode(col, "colocated", dataset, args.out, args)
    b = run_mode(dis, "disaggregated", dataset, args.out, args)
    ray.shutdown()
    table = compare_results(a, b)
    print(table)
    if args.write:
        from engine.benchmarks_md import provenance, write_section

        cmd = "python -m cluster.bench.modes " + " ".join(sys.argv[1:] if argv is None else argv)
        body = (f"## Disaggregated vs colocated\n\nSame 2 CPUs, same model ({args.dtype}), same workload: "
                f"{int(args.long_frac * 100)}% long prompts (~{args.long_words} words, 8 new tokens) among short "
                f"chat-like requests (96 new tokens), Poisson arrivals at {args.rates} req/s, "
                f"{args.num_prompts} requests per rate. Colocated: 2 replicas doing both phases; disaggregated: "
                f"1 prefill + 1 decode replica, KV over the grpc transport. SLOs: TTFT {args.slo_ttft_ms:.0f} ms, "
                f"TPOT {args.slo_tpot_ms:.0f} ms. A = colocated, B = disaggregated.\n\n{table}\n\n"
                f"Plots and per-request records: `{args.out}/<mode>/` (latency CDFs, goodput and p99 ITL "
                f"against rate).\n\n{provenance(cmd)}\n")
        write_section(body)


if __name__ == "__main__":
    main()
