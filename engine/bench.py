"""kvrelay's engine against transformers' ``generate`` on the same model, in one process.

    python -m engine.bench                        # print the table
    python -m engine.bench --write                # also replace `## Engine` in BENCHMARKS.md
    python -m engine.bench --isa avx512bf16,avx512,avx2  # each kernel ISA path, side by side, one run
    python -m engine.bench --quantization none,gguf,int8 --isa avx512bf16,avx2
                                                  # every weight format on every path, one run
    python -m engine.bench --profile runs/prof    # only: torch.profiler over decode steps
    kvrelay bench-engine ...                      # the same, from the CLI

Figures (greedy, EOS ignored, same random prompts for both):

- single-stream decode tokens/s: one 128-token prompt, 128 new tokens;
  (new tokens - 1) / (end-to-end time - time to first token);
- time to first token: one 128-token prompt, one new token (median of 3);
- batch-16 output tokens/s: 16 x 128-token prompts, 128 new tokens each;
  all output tokens / wall time;
- each throughput as a fraction of the memory wall: the tokens/s that
  reading every weight once per step at the measured read bandwidth would
  give (batch: times the batch, since one step's weight read serves all).

Each kernel ISA path asked for (`--isa`, engine/kernels.py; bf16 on CPU) runs
in the same process, one after another, against one transformers run; with
`--quantization`, each weight format on each path ("none": `--dtype`; "gguf",
"int8": quantized weights with fp32 activations, engine/quant.py), each column
named by its format and ISA path. The memory wall counts the bytes of the
weights as each format stores them.

The transformers baseline runs on whatever kernels torch picks for this CPU
(its column names them: `torch.backends.cpu.get_cpu_capability()`). Where the
avx2 path is asked for on a CPU with AVX-512, a second baseline runs in a
subprocess with torch held to AVX2 (`TORCH_AVX2_ENV`: ATen's kernels and
oneDNN's), what a user of an AVX2-only CPU (a Zen 3) gets; the avx2 columns'
ratios are against that one, the others' against the unrestricted one.

The engine runs with the prefix cache off, since transformers has none and
the same prompts are run repeatedly. Each workload is warmed up once (same
shapes, 16 new tokens) before it is timed.
"""
from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from engine.bench_transformers import (TORCH_AVX2_ENV, WARMUP_TOKENS, Figures, baseline_label,  # noqa: F401
                                       bench_transformers_avx2, run_transformers, torch_capability,
                                       transformers_only)
# (write_section through the module: tests redirect it there, and a name bound here would keep their stand-in)
from engine import benchmarks_md
from engine.benchmarks_md import BENCHMARKS_FILE, cpu_isa_text, provenance

SECTION = "## Engine"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="checkpoint folder or .gguf (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--isa", type=_isa_list, default=["auto"], metavar="ISA[,ISA...]",
                   help="CPU kernel ISA paths to run, comma-separated: auto (the best this CPU runs), "
                        "avx512bf16, avx512, avx2, none (torch's ops); several run side by side")
    p.add_argument("--quantization", type=_quant_list, default=["none"], metavar="Q[,Q...]",
                   help="weight formats to run, comma-separated: none (--dtype), gguf (the GGUF's own "
                        "blocks), int8; each on every --isa path")
    p.add_argument("--rounds", type=int, default=1,
                   help="kvrelay's workloads this many times, every path once per round (interleaved, so "
                        "the machine's load falls on all alike); the tables give each figure's median and "
                        "list every round's single-stream figures")
    p.add_argument("--write", action="store_true", help=f"replace the '{SECTION}' section of BENCHMARKS.md")
    p.add_argument("--section", default=SECTION, help="the BENCHMARKS.md section --write replaces")
    p.add_argument("--benchmarks-file", type=Path, default=BENCHMARKS_FILE, help=argparse.SUPPRESS)
    p.add_argument("--profile", metavar="DIR", type=Path, default=None,
                   help="instead of the comparison, profile a few engine decode steps: "
                        "write a Chrome trace to DIR and print the top ops")
    # the restricted baseline's subprocess: run transformers only on the prompts in FILE, print JSON
    p.add_argument("--transformers-only", metavar="FILE", type=Path, default=None, help=argparse.SUPPRESS)


def _isa_list(text: str) -> list[str]:
    from engine.config import KERNEL_ISAS

    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in KERNEL_ISAS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"{text!r}: each must be one of {', '.join(KERNEL_ISAS)}")
    return names


def _quant_list(text: str) -> list[str]:
    from engine.config import QUANTIZATIONS

    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in QUANTIZATIONS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"{text!r}: each must be one of {', '.join(QUANTIZATIONS)}")
    return names


def isa_label(llm) -> str:
    """The kernel path the engine runs: a native ISA, or torch's ops."""
    return getattr(llm.core.model.ops, "isa", "torch ops")


def make_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Random token ids, clear of the low ids where tokenizers keep special tokens."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(min(100, vocab // 2), vocab, (n, length), generator=g).tolist()


# ---- kvrelay -------------------------------------------------------------------

def _kv_params(n: int):
    from engine.sampling import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def decode_tok_s(out) -> float:
    """Single-stream decode rate of one finished request: the tokens after the first over their time."""
    return (len(out.token_ids) - 1) / (out.metrics["e2e"] - out.metrics["ttft"])


def step_weight_bytes(model) -> int:
    """The bytes of weights one decode step reads: every matmul weight once (a tensor or a packed weight)."""
    return sum(w.nbytes for w in [model.lm_head] + [w for L in model.layers
                                                    for w in (L.qkv_w, L.o_w, L.gate_up_w, L.down_w)])


def bench_kvrelay(llm, prompt: list[int], batch: list[list[int]], new: int) -> Figures:
    llm.generate(prompt, _kv_params(WARMUP_TOKENS))
    llm.generate(batch, _kv_params(WARMUP_TOKENS))

    out = llm.generate(prompt, _kv_params(new))[0]
    assert len(out.token_ids) == new
    decode = decode_tok_s(out)

    ttfts = []
    for _ in range(3):
        t0 = time.perf_counter()
        llm.generate(prompt, _kv_params(1))
        ttfts.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    outs = llm.generate(batch, _kv_params(new))
    wall = time.perf_counter() - t0
    assert all(len(o.token_ids) == new for o in outs)
    return Figures(decode, statistics.median(ttfts), len(batch) * new / wall)


@dataclass
class Breakdown:
    step_ms: float  # one single-stream decode step, end to end
    layers_ms: float  # the decoder stack (model.forward)
    head_ms: float  # the LM head (compute_logits)
    weight_mb: float  # bytes read per step: every weight once
    read_gb_s: float  # this machine's read bandwidth, measured alongside

    @property
    def bound_tok_s(self) -> float:
        return self.read_gb_s * 1e3 / self.weight_mb


def decode_breakdown(llm, prompt: list[int], new: int) -> Breakdown:
    """Where a single-stream decode step goes: time the model's two calls
    inside a real generate (one-token steps only), the rest is scheduling,
    sampling and detokenizing; and the memory-read bound next to it."""
    import torch

    model = llm.core.model
    spent = {"forward": 0.0, "logits": 0.0}

    def timed(name, fn):
        def call(x, *a, **kw):
            t0 = time.perf_counter()
            out = fn(x, *a, **kw)
            if x.shape[0] == 1:
                spent[name] += time.perf_counter() - t0
            return out
        return call

    model.forward = timed("forward", model.forward)
    model.compute_logits = timed("logits", model.compute_logits)
    try:
        out = llm.generate(prompt, _kv_params(new))[0]
    finally:
        del model.forward, model.compute_logits  # back to the class's methods
    steps = new - 1
    decode_s = out.metrics["e2e"] - out.metrics["ttft"]
    # fp32: torch's bf16 sum widens every element first and is bound by that on an AVX2 CPU (a Zen 3
    # core: 12.8 GB/s, against 17.3 for fp32 and 15.3 for a plain AVX2 read loop), which would put the
    # bound too low and every figure too near it
    big = torch.ones(128 << 20, dtype=torch.float32)  # 512 MB, far past any cache
    big.sum()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        big.sum()
        best = min(best, time.perf_counter() - t0)
    read = big.numel() * big.element_size() / best
    return Breakdown(decode_s / steps * 1e3, spent["forward"] / steps * 1e3, spent["logits"] / steps * 1e3,
                     step_weight_bytes(model) / 1e6, read / 1e9)


def rounds_text(rounds: dict[str, list[Figures]], dtype: str) -> str:
    """Every round's single-stream decode figure per run (label: "<format> <path>"
    when several formats ran, else the path), and each quantized run's ratio to
    the unquantized run on the same ISA path, round by round."""
    lines = [f"kvrelay's figures above are medians of {len(next(iter(rounds.values())))} interleaved rounds "
             "(every run once per round). Single-stream decode tokens/s, round by round:", ""]
    lines += [f"- {n}: " + ", ".join(f"{f.decode_tok_s:.1f}" for f in figs) for n, figs in rounds.items()]
    for n, figs in rounds.items():
        fmt, _, path = n.partition(" ")
        base = f"{dtype} {path}"
        if path and fmt != dtype and base in rounds:
            ratios = [f.decode_tok_s / b.decode_tok_s for f, b in zip(figs, rounds[base])]
            lines.append(f"- {n} / {base}, same round: " + ", ".join(f"{x:.2f}x" for x in ratios)
                         + f" (median {statistics.median(ratios):.2f}x)")
    return "\n".join(lines)


def breakdown_table(b: Breakdown, label: str = "") -> str:
    rest = b.step_ms - b.layers_ms - b.head_ms
    return "\n".join([
        f"| part of one single-stream decode step{label} | ms |",
        "|---|---:|",
        f"| decoder layers (`model.forward`) | {b.layers_ms:.2f} |",
        f"| LM head | {b.head_ms:.2f} |",
        f"| the rest: scheduling, batch preparation, sampling, detokenizing | {rest:.2f} |",
        f"| whole step | {b.step_ms:.2f} ({1e3 / b.step_ms:.1f} tokens/s) |",
        f"| bound: {b.weight_mb:.0f} MB of weights read at the measured {b.read_gb_s:.1f} GB/s "
        f"| {b.weight_mb / b.read_gb_s:.2f} ({b.bound_tok_s:.1f} tokens/s) |",
        f"| the step against the bound (the memory wall) | {100 * b.weight_mb / b.read_gb_s / b.step_ms:.0f}% |",
    ])


# ---- report --------------------------------------------------------------------

def table(kvs: dict[str, Figures], hfs: dict[str, Figures], args, walls: dict[str, float] | None = None,
          against: dict[str, str] | None = None) -> str:
    """kvrelay's figures for each kernel path (label -> Figures) against transformers'
    (torch's CPU capability, what it ran on -> Figures); against: kvrelay label -> the
    capability of the baseline its ratios are taken against (default: the first); walls:
    label -> the single-stream memory-wall tokens/s (Breakdown.bound_tok_s)."""
    first = next(iter(hfs))
    base = {n: hfs[(against or {}).get(n, first)] for n in kvs}
    metrics = [
        (f"single-stream decode, tokens/s ({args.prompt_len}-token prompt, {args.new_tokens} new)",
         lambda f: f"{f.decode_tok_s:.1f}", lambda k, hf: k.decode_tok_s / hf.decode_tok_s),
        (f"time to first token, ms ({args.prompt_len}-token prompt)",
         lambda f: f"{f.ttft_s * 1e3:.0f}", lambda k, hf: hf.ttft_s / k.ttft_s),
        (f"batch-{args.batch} output tokens/s ({args.prompt_len}-token prompts, {args.new_tokens} new each)",
         lambda f: f"{f.batch_tok_s:.1f}", lambda k, hf: k.batch_tok_s / hf.batch_tok_s),
    ]
    one = len(kvs) == 1
    heads = ["kvrelay"] if one else [f"kvrelay {n}" for n in kvs]
    vs = (lambda n: "") if len(hfs) == 1 else (lambda n: f" (vs torch {(against or {}).get(n, first)})")
    ratios = [f"ratio{vs(next(iter(kvs)))}"] if one else [f"ratio {n}{vs(n)}" for n in kvs]
    lines = ["| metric | " + " | ".join(heads + [baseline_label(c) for c in hfs] + ratios) + " |",
             "|---|" + "---:|" * (2 * len(kvs) + len(hfs))]
    for m, fmt, ratio in metrics:
        lines.append(f"| {m} | " + " | ".join([fmt(k) for k in kvs.values()] + [fmt(hf) for hf in hfs.values()]
                                             + [f"{ratio(k, base[n]):.2f}x" for n, k in kvs.items()]) + " |")
    if walls:
        walls_row = {"single": lambda n: kvs[n].decode_tok_s / walls[n],
                     "batch": lambda n: kvs[n].batch_tok_s / (walls[n] * args.batch)}
        for what, frac in walls_row.items():
            label = ("single-stream decode" if what == "single" else f"batch-{args.batch} output") + \
                " against the memory wall (weights read once per step at the measured bandwidth)"
            lines.append(f"| {label} | " + " | ".join([f"{100 * frac(n):.0f}%" for n in kvs] + ["-"] * len(hfs)
                                                      + ["-"] * len(kvs)) + " |")
    return "\n".join(lines)


def section(body: str, args, model_name: str, command: str, isas: list[str], baselines: list[str]) -> str:
    formats = "" if args.quantization == ["none"] else \
        f" (transformers), weights {', '.join('`' + q + '`' for q in args.quantization)} (kvrelay)"
    avx2 = "" if len(baselines) == 1 else (
        f"\n{baselines[1]} ran in a subprocess with "
        f"{' '.join(f'`{k}={v}`' for k, v in TORCH_AVX2_ENV.items())} (what an AVX2-only CPU's torch "
        "runs), on the same prompts; the avx2 columns' ratios are against it, the others' against "
        f"{baselines[0]}, torch's own choice on this CPU.")
    return f"""{args.section}

`engine.LLM` against transformers' `generate` on {model_name}, {args.dtype}{formats}, greedy, EOS ignored,
kernel ISA path {" and ".join(f"`{n}`" for n in isas)} (engine/kernels.py; the CPU runs {cpu_isa_text()}),
same random prompts, one process, each workload warmed up once (`engine/bench.py`).
Ratio: how many times better kvrelay is (throughput: kvrelay / transformers; time to first
token: transformers / kvrelay).{avx2}

{body}

{provenance(command)}
- What bounds each figure: single-stream decode is one token per step, so it is bound by reading
  every weight once per token (memory bandwidth) plus per-step overhead; the second table splits
  one such step (timed inside a real generate) and puts the read bound beside it; time to first token is the prefill of {args.prompt_len} tokens, bound by matmul compute; batch
  throughput shares each weight read across {args.batch} sequences, so it is bound by compute
  (matmuls, and attention over the paged cache that grows with each token).
- The machine is shared with other jobs, so these figures are noisy: with more runnable
  threads than cores, torch's spinning intra-op threads slow small steps by up to tens of
  times. Compare ratios from one quiet run, not figures across runs.
"""


# ---- profile -------------------------------------------------------------------

def profile(llm, prompt: list[int], out_dir: Path, num_steps: int = 8) -> str:
    """Profile `num_steps` decode steps of one sequence; returns the top-ops table."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    out_dir.mkdir(parents=True, exist_ok=True)
    llm.generate(prompt, _kv_params(WARMUP_TOKENS))  # warm-up
    rid = llm.add_request(prompt, _kv_params(num_steps + 2))
    llm.step()  # the prefill
    with torch_profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(num_steps):
            llm.step()
    while llm.has_unfinished():
        llm.step()
    llm.abort(rid)
    trace = out_dir / "engine_decode_trace.json"
    prof.export_chrome_trace(str(trace))
    print(f"wrote {trace} ({num_steps} decode steps)")
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)


# ---- main ----------------------------------------------------------------------

def run(args: argparse.Namespace, command: str | None = None) -> int:
    import torch

    from engine.llm import LLM
    from engine.weights import resolve_model

    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model)
    model_name = Path(model_dir).name if args.model else "SmolLM2-135M-Instruct"
    if args.transformers_only is not None:
        return transformers_only(args, model_dir)

    def make_llm(run: tuple[str, str]):
        quant, isa = run
        return LLM(str(model_dir), dtype=args.dtype if quant == "none" else "float32", enable_prefix_caching=False,
                   kernel_isa=isa, quantization=quant, max_num_batched_tokens=max(2048, args.batch * args.prompt_len))

    runs = [(q, isa) for q in args.quantization for isa in args.isa]
    llm = make_llm(runs[0])
    prompts = make_prompts(args.batch + 1, args.prompt_len, llm.model_config.vocab_size)
    prompt, batch = prompts[0], prompts[1:]

    if args.profile is not None:
        print(f"kernel ISA path: {isa_label(llm)}")
        print(profile(llm, prompt, args.profile))
        return 0

    if args.rounds < 1:
        raise SystemExit(f"--rounds must be at least 1, got {args.rounds}")
    kvs: dict[str, Figures] = {}
    parts: dict[str, Breakdown] = {}
    paths: dict[str, str] = {}  # label -> the kernel ISA path of its run
    rounds: dict[str, list[Figures]] = {}
    llms = {runs[0]: llm}  # run -> its LLM, kept between rounds (one round: each freed after its run)
    del llm
    for r in range(args.rounds):
        for run in runs:
            if run not in llms:
                llms[run] = make_llm(run)
            model = llms[run]
            label = isa_label(model)
            path = label
            if args.quantization != ["none"]:
                label = f"{args.dtype if run[0] == 'none' else run[0]} {label}"
            paths[label] = path
            print(f"kvrelay ({model_name}, {label}) round {r + 1}/{args.rounds} ...", file=sys.stderr)
            rounds.setdefault(label, []).append(bench_kvrelay(model, prompt, batch, args.new_tokens))
            if r + 1 == args.rounds:
                parts[label] = decode_breakdown(model, prompt, args.new_tokens)
            assert model.core.pool.is_fully_free()
            if args.rounds == 1:
                del llms[run]
            del model
    llms.clear()
    for label, figs in rounds.items():
        kvs[label] = Figures(*(statistics.median(getattr(f, n) for f in figs) for n in Figures.__dataclass_fields__))

    native = torch_capability()
    print(f"transformers (torch {native}) ...", file=sys.stderr)
    hfs = {native: run_transformers(model_dir, args.dtype, prompt, batch, args.new_tokens)}
    against: dict[str, str] = {}
    if "avx2" in paths.values() and native != "AVX2":
        # a fair baseline for the avx2 path: torch on AVX2 too, as an AVX2-only CPU runs it
        print("transformers (torch AVX2, a subprocess) ...", file=sys.stderr)
        hfs["AVX2"] = bench_transformers_avx2(args, model_dir, prompt, batch)
        against = {n: "AVX2" for n, path in paths.items() if path == "avx2"}

    one = len(parts) == 1
    body = "\n\n".join([table(kvs, hfs, args, {n: b.bound_tok_s for n, b in parts.items()}, against)]
                       + ([rounds_text(rounds, args.dtype)] if args.rounds > 1 else [])
                       + [breakdown_table(b, "" if one else f" ({n})") for n, b in parts.items()])
    print(f"kernel ISA path: {', '.join(kvs)}")
    print(body)
    if args.write:
        command = command or "python -m engine.bench " + shlex.join(sys.argv[1:])
        text = section(body, args, model_name, command.strip(), list(dict.fromkeys(paths.values())),
                       [baseline_label(c) for c in hfs])
        benchmarks_md.write_section(text, args.benchmarks_file)
        print(f"wrote the '{args.section}' section of {args.benchmarks_file}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine.bench", description=__doc__.split("\n")[0])
    add_arguments(ap)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
