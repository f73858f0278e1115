"""`kvrelay bench` and `kvrelay bench compare`.

    kvrelay bench --num-prompts 200 --input-len 512 --output-len 128 --rates 1,2,4,8 \\
        --slo-ttft-ms 500 --slo-tpot-ms 50 --duration-s 120 --label disagg --out runs/disagg
    kvrelay bench --backend openai --base-url http://127.0.0.1:8000/v1 --request-rate 4
    kvrelay bench compare runs/coloc/results.json runs/disagg/results.json
"""
from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys

# The bench modules (aiohttp, grpc, matplotlib) are imported when the command runs, not when
# `kvrelay` builds its parser for some other command.


def _rates(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers or inf, got {text!r}") from None
    if not rates or any(not r > 0 for r in rates):
        raise argparse.ArgumentTypeError(f"rates must be > 0 (or inf), got {text!r}")
    return rates


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="measure serving latency and throughput (see also: bench compare)",
                       description="Send a workload at one or more request rates and report TTFT, TPOT, ITL, "
                                   "E2E latency, throughput and goodput.")
    g = p.add_argument_group("server")
    g.add_argument("--backend", choices=("kvrelay", "openai"), default="kvrelay",
                   help="kvrelay: the gRPC API; openai: streaming /v1/completions of any OpenAI-compatible server")
    g.add_argument("--target", default="127.0.0.1:50051", help="gRPC host:port (kvrelay backend)")
    g.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="API root (openai backend)")
    g.add_argument("--api-key", default=os.environ.get("KVRELAY_API_KEY"), help="default: $KVRELAY_API_KEY")
    g.add_argument("--tls", action="store_true", help="gRPC over TLS")
    g.add_argument("--root-certs", help="PEM roots to trust (implies --tls)")
    g.add_argument("--model", default="", help="default: the served model (the first listed, over HTTP)")

    g = p.add_argument_group("workload")
    g.add_argument("--num-prompts", type=int, default=100, help="measured requests per rate (100)")
    g.add_argument("--input-len", type=int, default=256, help="mean prompt length in tokens (256)")
    g.add_argument("--output-len", type=int, default=128, help="mean output length in tokens (128)")
    g.add_argument("--range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len*(1-r), len*(1+r)] (0: fixed)")
    g.add_argument("--dataset", help="JSON lines with 'prompt' and optional 'output_len' (instead of random)")
    g.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="generate exactly the requested lengths (default on)")
    g.add_argument("--temperature", type=float, default=None, help="default: the server's")
    g.add_argument("--seed", type=int, default=0)

    g = p.add_argument_group("arrivals")
    rate = g.add_mutually_exclusive_group()
    rate.add_argument("--request-rate", type=float, help="requests/s, Poisson (inf: all at once; the default)")
    rate.add_argument("--rates", type=_rates, help="a sweep, e.g. 1,2,4,8")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the arrival gaps: 1 is Poisson, < 1 burstier, > 1 steadier")
    g.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    g.add_argument("--warmup", type=int, default=0, help="requests sent first and left out of the stats")
    g.add_argument("--duration-s", type=float, default=None,
                   help="stop issuing after this many seconds per rate; cancel what still runs after --grace-s")
    g.add_argument("--grace-s", type=float, default=10.0, help="after --duration-s (10)")

    g = p.add_argument_group("report")
    g.add_argument("--slo-ttft-ms", type=float, default=None, help="TTFT objective for goodput/attainment")
    g.add_argument("--slo-tpot-ms", type=float, default=None, help="TPOT objective for goodput/attainment")
    g.add_argument("--label", help="a name for this run (shown in tables, plots and comparisons)")
    g.add_argument("--out", help="directory for results.json and the PNG plots")
    g.add_argument("--no-plots", action="store_true", help="with --out, write results.json only")
    g.add_argument("--quiet", action="store_true", help="no progress line on stderr")

    bench_sub = p.add_subparsers(dest="bench_command", metavar="{compare}")
    c = bench_sub.add_parser("compare", help="two results.json side by side, as a markdown table")
    c.add_argument("a", help="results.json of the baseline (A)")
    c.add_argument("b", help="results.json to compare with it (B)")
    c.add_argument("--out", dest="compare_out", help="also write the table to this file")
    c.add_argument("--plots", dest="compare_plots", metavar="DIR",
                   help="also draw the two results together as PNGs in DIR (CDFs at the highest common rate; "
                        "goodput and TPOT p99 against rate for sweeps)")


def config_from_args(args: argparse.Namespace):
    from cluster.bench.runner import BenchConfig

    rates = args.rates or [args.request_rate if args.request_rate is not None else math.inf]
    return BenchConfig(
        backend=args.backend, target=args.target, base_url=args.base_url, api_key=args.api_key,
        tls=args.tls or bool(args.root_certs), root_certs=args.root_certs, model=args.model,
        num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len,
        range_ratio=args.range_ratio, dataset=args.dataset, ignore_eos=args.ignore_eos,
        temperature=args.temperature, seed=args.seed, rates=rates, burstiness=args.burstiness,
        max_concurrency=args.max_concurrency, warmup=args.warmup, duration_s=args.duration_s,
        grace_s=args.grace_s, slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms, label=args.label)


def main(args: argparse.Namespace) -> int:
    if args.bench_command == "compare":
        return _compare(args)
    from cluster.bench.clients import BenchError
    from cluster.bench.plots import write_plots
    from cluster.bench.report import format_tables, result_to_json, write_results
    from cluster.bench.runner import run_bench
    from cluster.bench.workload import WorkloadError

    try:
        result = asyncio.run(run_bench(config_from_args(args), progress_stream=None if args.quiet else sys.stderr))
    except (BenchError, WorkloadError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    data = result_to_json(result)
    print(format_tables(data))
    if args.out:
        path = write_results(data, args.out)
        written = [path]
        if not args.no_plots:
            written += write_plots(data, args.out)
        print("wrote " + ", ".join(str(p) for p in written))
    return 0


def _compare(args: argparse.Namespace) -> int:
    from cluster.bench.report import compare_results, load_results

    try:
        a, b = load_results(args.a), load_results(args.b)
        table = compare_results(a, b)
    except (OSError, ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(table)
    if args.compare_out:
        with open(args.compare_out, "w") as f:
            f.write(table + "\n")
    if args.compare_plots:
        from cluster.bench.plots import write_comparison

        written = write_comparison(a, b, args.compare_plots)
        print("wrote " + ", ".join(str(p) for p in written))
    return 0
