"""GGUF weights as held now against as held before, side by side: k-quant scales as stored (4-,
6- or 8-bit codes and an fp32 factor per 256 k) against multiplied out to fp32 per 16 or 32 k,
Q4_0 as signed nibbles against unsigned nibbles with an fp16 minimum (-8 x scale) stored, and
IQ4_NL / IQ4_XS as 4-bit indices looked up in registers against the signed bytes they stand for.

    python -m engine.kscale_bench                      # every ISA path this CPU runs, 1 and 2 threads
    python -m engine.kscale_bench --rounds 5 --write

A decode step's matmuls for one layer of a Llama-3-8B-shaped model (q|k|v 6144 x 4096, o 4096 x
4096, gate|up 28672 x 4096, down 4096 x 14336: 218M weights, far past any cache), all in one GGUF
type, or (Q4_K_M) as llama.cpp's Q4_K_M lays out a layer whose v and down projections take
Q6_K (q|k|v then fuses Q4_K q and k with a Q6_K v), run back to back for 1 and for 8 token rows.
(Q2_K and Q3_K were refused before; their "before" is their scales multiplied out.) Both forms of
the same weights are packed in one process and timed in interleaved rounds, each round's ratio taken within the round (these
machines are shared and noisy). The codes are random bytes with finite super-block factors, so
every bit of the packed scales is in play. The k-quants' two forms give the same bits (the same
products, in the same order); Q4_0's differ in the last bits (signed nibbles drop 8 x the sum of x
as an integer, the form before added -8 x scale times it in fp32): checked each run.
The weights are held in transparent huge pages, as a model's are (engine/hugepages.py).
The memory wall is the layer's bytes over the read bandwidth measured in the same run.
"""
from __future__ import annotations

import statistics
import sys
import time

SECTION = "## GGUF weights as held now and before: k-quant scale codes, signed nibbles"
TYPES = ("Q4_K", "Q6_K", "Q4_K_M", "Q2_K", "Q3_K", "Q4_0", "IQ4_NL", "IQ4_XS")
SHAPES = (("q|k|v", 6144, 4096), ("o", 4096, 4096), ("gate|up", 28672, 4096), ("down", 4096, 14336))


def random_rows(type_name: str, n: int, k: int, seed: int):
    """A GGUF tensor of `type_name` with random codes and scales (QuantRows as read)."""
    import gguf
    import numpy as np

    from engine.gguf_blocks import gguf_rows

    per, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    raw = np.random.default_rng(seed).integers(0, 256, (n, k // per, size), dtype=np.uint8)
    at = {"Q6_K": [size - 2], "Q3_K": [size - 2], "Q2_K": [size - 4, size - 2], "Q4_0": [0], "IQ4_NL": [0],
          "IQ4_XS": [0]}.get(type_name, [0, 2])
    for i, v in zip(at, (0.004, 0.002)):  # fp16 d (and dmin): finite
        raw[..., i:i + 2] = np.frombuffer(np.float16(v).tobytes(), np.uint8)
    return gguf_rows(raw.reshape(n, -1), type_name, (n, k), f"random {type_name}")


def layer_rows(type_name: str, shapes) -> list:
    """The layer's four matrices (QuantRows, coded scales) in `type_name`, or Q4_K_M's mix."""
    from engine.quant import QuantRows

    if type_name != "Q4_K_M":
        return [random_rows(type_name, n, k, i) for i, (_, n, k) in enumerate(shapes)]
    (_, nqkv, k), *rest = shapes
    nv = nqkv // 6  # Llama-3-8B: q 4096, k and v 1024 each
    qkv = QuantRows.cat([random_rows("Q4_K", nqkv - nv, k, 0), random_rows("Q6_K", nv, k, 1)], "q|k|v")
    return [qkv] + [random_rows("Q6_K" if name == "down" else "Q4_K", n, k, 2 + i)
                    for i, (name, n, k) in enumerate(rest)]


def held_before(rows):
    """`rows` as held before: k-quant scales multiplied out to fp32; Q4_0 as unsigned nibbles with
    an fp16 minimum -8 x scale stored (Q4_1's form); IQ4 indices as the signed bytes they stand
    for (the i-quants were refused before; this is the form they were first read in)."""
    from engine.quant import QuantRows

    if rows.fmt == "q4_0":
        return QuantRows("q4_0", 4, rows.codes + 8, rows.scales, -8 * rows.scales)
    if rows.grid is not None:
        return rows.valued()
    return rows.decoded()


def in_huge_pages(w):
    """`w` with its tensors in transparent huge pages where the kernel allows, as a model holds them."""
    from engine.hugepages import pack

    return w.with_tensors(*pack(w.tensors()))


def read_gb_s() -> float:
    """The read bandwidth of this process's threads: the fastest of 3 fp32 sums of 512 MB (as engine.bench)."""
    import torch

    big = torch.ones(128 << 20, dtype=torch.float32)
    big.sum()
    best = min(_timed(big.sum) for _ in range(3))
    return big.nbytes / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run(types: list[str], isas: list[str], threads: list[int], rows: list[int], rounds: int, reps: int,
        shrink: int = 1) -> str:
    import torch

    from engine.kernels import QuantOps, load_native_ops
    from engine.quant import QuantWeight

    shapes = [(name, n // shrink, k // shrink) for name, n, k in SHAPES]
    if any(k % 256 for _, _, k in shapes):
        raise SystemExit(f"--shrink {shrink}: rows of {[k for _, _, k in shapes]} are not whole super-blocks of 256")
    lines = []
    for type_name in types:
        coded = layer_rows(type_name, shapes)
        forms = {"now": [in_huge_pages(QuantWeight.pack(r)) for r in coded],
                 "before": [in_huge_pages(QuantWeight.pack(held_before(r))) for r in coded]}
        del coded
        mb = {f: sum(w.nbytes for w in ws) / 1e6 for f, ws in forms.items()}
        weights = sum(n * k for _, n, k in shapes)
        for isa in isas:
            ops = QuantOps(load_native_ops(isa))
            for t in threads:
                torch.set_num_threads(t)
                wall = read_gb_s()
                for m in rows:
                    xs = [torch.randn(m, k, generator=torch.Generator().manual_seed(k)) for _, _, k in shapes]

                    def layer(ws):
                        return [ops.linear(x, w) for x, w in zip(xs, ws)]
                    outs = list(zip(layer(forms["now"]), layer(forms["before"])))
                    diff = max(((a - b).abs().max() / b.abs().max()).item() for a, b in outs)
                    agree = "same bits" if all(torch.equal(a, b) for a, b in outs) else f"within {diff:.0e}"
                    ms = {f: [] for f in forms}
                    for r in range(rounds):
                        for f, ws in forms.items():
                            layer(ws)
                            ms[f].append(statistics.median(_timed(lambda: layer(ws)) for _ in range(reps)) * 1e3)
                        print(f"{type_name} {isa} {t} thread(s) {m} row(s) round {r + 1}/{rounds}: "
                              + ", ".join(f"{f} {v[-1]:.2f} ms" for f, v in ms.items()), file=sys.stderr)
                    speedups = [b / a for a, b in zip(ms["now"], ms["before"])]
                    med = {f: statistics.median(v) for f, v in ms.items()}
                    at_wall = {f: mb[f] / 1e3 / wall / (med[f] / 1e3) for f in forms}
                    lines.append(
                        f"| {type_name} | {isa} | {t} | {m} | {med['before']:.2f} ({at_wall['before']:.0%}) "
                        f"| {med['now']:.2f} ({at_wall['now']:.0%}) | {wall:.1f} "
                        f"| {', '.join(f'{x:.2f}' for x in speedups)} | **{statistics.median(speedups):.2f}x** "
                        f"| {agree} |")
        lines.append(f"| {type_name}: MB a layer | | | | {mb['before']:.1f} ({mb['before'] * 8e6 / weights:.3g} bits "
                     f"a weight) | {mb['now']:.1f} ({mb['now'] * 8e6 / weights:.3g} bits) | | | | |")
        del forms
    return ("| type | ISA path | threads | token rows | before: ms (of the wall) | now: ms "
            "(of the wall) | read GB/s | before / now time, each round | median | outputs agree |\n"
            "|---|---|---:|---:|---:|---:|---:|---|---:|---|\n" + "\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    from engine.benchmarks_md import command_line, comma_list, cpu_isa_text, provenance, publish, side_by_side_parser

    p = side_by_side_parser("engine.kscale_bench", __doc__, SECTION, single_stream=False)
    p.add_argument("--types", default=",".join(TYPES), help="GGUF k-quant types, comma-separated")
    p.add_argument("--rows", default="1,8", help="token rows per matmul (decode batch sizes), comma-separated")
    p.add_argument("--reps", type=int, default=9, help="timed calls per round and form (the median is kept)")
    p.add_argument("--shrink", type=int, default=1, help="divide every matrix's sides by this (a quick check)")
    args = p.parse_args(argv)
    body = run(comma_list(args.types), comma_list(args.isa), comma_list(args.threads, int), comma_list(args.rows, int),
               args.rounds, args.reps, args.shrink)
    command = command_line("engine.kscale_bench", argv)
    text = (f"{args.section}\n\nWritten by `engine/kscale_bench.py`: one decode step's matmuls for a layer of a "
            "Llama-3-8B-shaped model (218M weights), every matrix in one GGUF type, as held now (k-quant scales "
            "as stored: 4-, 6- or 8-bit codes and fp32 factors per 256 k; Q4_0 as signed nibbles) and as held "
            "before (k-quant scales multiplied out to fp32, Q2_K and Q3_K being refused then; Q4_0 with an fp16 "
            "minimum stored; IQ4_NL and IQ4_XS, refused too, as the signed bytes their indices stand for), side by "
            "side in "
            f"one process, interleaved rounds; the CPU runs {cpu_isa_text()}. Times are medians of "
            f"{args.rounds} rounds; \"of the wall\": the layer's bytes read at the bandwidth measured in the "
            f"same run.\n\n{body}\n{provenance(command)}\n")
    return publish(text, args.write)


if __name__ == "__main__":
    raise SystemExit(main())
