"""bf16 matmul throughput by rows: kvrelay's packed kernel against torch's fp32 SGEMM on the same
shapes, side by side on this machine.

    python -m engine.matmul_bench
    python -m engine.matmul_bench --isa avx2 --threads 1,2 --rows 8,16,256,1024 --write

The default model's four layer matrices and its LM head, at decode batch sizes and at prefill's
(`--rows`). kvrelay's kernel (`linear_packed`: bf16 weights packed once, widened to fp32 in
registers on AVX2, fp32 sums in k order) against `torch.mm` on the same weights held in fp32 (what
a server that keeps fp32 weights runs; vLLM-CPU's `--dtype float32`): GFLOPS (2 M N K over the
best of `--rounds` timings), and the ratio, taken within the run. Same inputs; kvrelay's sums are
its own fixed order, so the two agree to fp32 rounding, not to the bit.
"""
from __future__ import annotations

import time

SECTION = "## bf16 matmul by rows against torch fp32 SGEMM"
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "LM head": (49152, 576)}


def gflops(fn, flops: float, rounds: int) -> float:
    fn()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return flops / best / 1e9


def run(isas: list[str], threads: list[int], rows: list[int], rounds: int) -> str:
    import torch

    from engine.kernels import PackedWeight, load_native_ops

    lines = []
    for isa in isas:
        ext = load_native_ops(isa)
        if ext is None:
            raise SystemExit(f"--isa {isa}: this CPU does not run it (or it did not build)")
        for t in threads:
            torch.set_num_threads(t)
            for name, (n, k) in SHAPES.items():
                g = torch.Generator().manual_seed(n + k)
                w = (torch.randn(n, k, generator=g) / k ** 0.5).bfloat16()
                packed, wf = PackedWeight.pack(w), w.float()
                for m in rows:
                    x = torch.randn(m, k, generator=g).bfloat16()
                    xf = x.float()
                    flops = 2.0 * m * n * k
                    ours = gflops(lambda: ext.linear_packed(x, packed.data, n, threads=t), flops, rounds)
                    theirs = gflops(lambda: torch.mm(xf, wf.t()), flops, rounds)
                    lines.append(f"| {isa} | {t} | {name} {n} x {k} | {m} | {ours:.0f} | {theirs:.0f} | "
                                 f"**{ours / theirs:.2f}x** |")
                    print(lines[-1], flush=True)
    return ("| ISA path | threads | matrix (N x K) | rows | kvrelay bf16, GFLOPS | torch fp32 `mm`, GFLOPS | "
            "kvrelay / torch |\n|---|---:|---|---:|---:|---:|---:|\n" + "\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    from engine.benchmarks_md import command_line, comma_list, cpu_isa_text, provenance, publish, side_by_side_parser

    p = side_by_side_parser("engine.matmul_bench", __doc__, SECTION, single_stream=False)
    p.set_defaults(threads="1", rounds=3)
    p.add_argument("--rows", default="8,16,256,1024", help="rows of x (tokens), comma-separated")
    args = p.parse_args(argv)
    isas, threads, rows = comma_list(args.isa), comma_list(args.threads, int), comma_list(args.rows, int)
    if not isas:
        raise SystemExit("no kernel ISA path to run: this CPU runs none (see engine/kernels.py)")
    if not rows or any(m < 1 for m in rows):
        raise SystemExit(f"--rows {args.rows}: each must be a positive number of rows")
    body = run(isas, threads, rows, args.rounds)
    command = command_line("engine.matmul_bench", argv)
    text = (f"{args.section}\n\nWritten by `engine/matmul_bench.py`, best of {args.rounds} timings each; the CPU "
            f"runs {cpu_isa_text()}.\n\n{body}\n{provenance(command)}\n")
    return publish(text, args.write)


if __name__ == "__main__":
    raise SystemExit(main())
