"""Pipeline parallelism on one host: what crosses a stage boundary, pipelined prefill of a
long prompt, and decode throughput with micro-batching, PP=2 against PP=1 on the same cores.

    python -m engine.parallel.pp_bench            # print the section
    python -m engine.parallel.pp_bench --write    # also replace `## Pipeline parallelism` in BENCHMARKS.md
    python -m engine.parallel.pp_bench --backend gloo   # PP=2's hand-offs over gloo point-to-point

SmolLM2-135M-Instruct (dtype auto). PP=1 runs on 2 threads, PP=2 on 1 thread per rank;
the runs alternate (PP=1, PP=2, PP=1, ...) in one process so that load from other work
falls on both alike, and the table gives each run's median over the rounds.

1. Bytes rank 0 handed to stage 1 per token (its StageChannel's count) against the theory,
   hidden_size x the activation dtype's size.
2. TTFT of one 4096-token prompt in chunks of ``--chunk`` tokens (prefix caching off): at
   PP=2, chunk k+1 runs on stage 0 while chunk k is on stage 1. The bubble left is the share
   of the two cores' time idle, 1 - T(PP=1) / T(PP=2) (taking PP=1's two threads as perfect
   scaling); the pipeline's own, with n chunks on 2 stages, is 1 / (n + 1).
3. Decode throughput of 16 streams (32-token prompts), tokens per second after every stream
   has its first token; PP=2 keeps two batches of 8 in flight. With ``--decode-context N``,
   also 16 streams of N-token prompts: each step then reads the streams' KV as well as the
   weights, and the KV, unlike the weights, is read once per step at PP=1 and PP=2 alike.
"""
from __future__ import annotations

import argparse
import os
import platform
import shlex
import statistics
import sys
import time

import torch

SECTION = "## Pipeline parallelism"


def _llm(pp: int, chunk: int, num_kv_blocks: int, prefix_caching: bool, backend: str = "shm", split=None):
    from engine.llm import LLM

    return LLM(None, pipeline_parallel_size=pp, max_num_batched_tokens=chunk, num_kv_blocks=num_kv_blocks,
               enable_prefix_caching=prefix_caching, max_num_seqs=16, tp_backend=backend, pipeline_layer_split=split)


def prefill(pp: int, prompt_len: int, chunk: int, backend: str = "shm") -> dict:
    from engine.sampling import SamplingParams
    from engine.sequence import Sequence

    vocab = 49152
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(10, vocab, (prompt_len,), generator=g).tolist()
    with _llm(pp, chunk, prompt_len // 16 + 8, False, backend) as llm:
        core = llm.core
        core.add(Sequence("warm", prompt[:chunk], SamplingParams(max_tokens=1)))
        while core.has_unfinished():
            core.step()
        core.add(Sequence("long", prompt, SamplingParams(max_tokens=1, ignore_eos=True)))
        t0 = time.perf_counter()
        while core.has_unfinished():
            core.step()
        ttft = time.perf_counter() - t0
        out = {"ttft_s": ttft, "dtype": core.dtype_name, "hidden": core.model_config.hidden_size}
        if pp > 1:
            st = core.tp_group.pipe.stats
            out["bytes_per_token"] = st.bytes_sent / st.tokens_sent
        return out


def decode(pp: int, streams: int, prompt_len: int, new_tokens: int, backend: str = "shm", split=None) -> dict:
    from engine.sampling import SamplingParams
    from engine.sequence import Sequence

    g = torch.Generator().manual_seed(1)
    with _llm(pp, 2048, streams * ((prompt_len + new_tokens) // 16 + 2), True, backend, split) as llm:
        core = llm.core
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        seqs = [Sequence(f"s{i}", torch.randint(10, 49152, (prompt_len,), generator=g).tolist(), params)
                for i in range(streams)]
        for s in seqs:
            core.add(s)
        while not all(s.output_token_ids for s in seqs):
            core.step()
        base = sum(len(s.output_token_ids) for s in seqs)
        t0 = time.perf_counter()
        while core.has_unfinished():
            core.step()
        dt = time.perf_counter() - t0
        return {"tok_s": (sum(len(s.output_token_ids) for s in seqs) - base) / dt}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=4096)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--decode-split", type=lambda v: [int(n) for n in v.split(",")], default=None,
                    help="also decode at PP=2 with this pipeline_layer_split (e.g. 17,13: fewer layers on the "
                         "last stage, which also runs the LM head)")
    ap.add_argument("--decode-context", type=int, default=0, metavar="N",
                    help="also decode 16 streams of N-token prompts at PP=1 (2 threads) and PP=2 (with "
                         "--decode-split if given)")
    ap.add_argument("--backend", choices=("shm", "gloo"), default="shm",
                    help="PP=2's hand-offs: the shared segment, or gloo point-to-point (engine.parallel.pipe)")
    ap.add_argument("--write", action="store_true", help=f"replace the '{SECTION}' section of BENCHMARKS.md")
    ap.add_argument("--section", default=SECTION, help="the BENCHMARKS.md section --write replaces (another CPU's)")
    args = ap.parse_args(argv)
    if args.write and args.backend != "shm":
        ap.error(f"--write replaces the '{args.section}' section, measured with shm; print the {args.backend} figures")
    # key: PP=1 on 2 threads (1), PP=2 (2), and as a control PP=1 on 1 thread (0)
    runs: dict[int, list] = {1: [], 2: [], 0: []}
    split_runs: list[float] = []  # PP=2 decode with --decode-split
    long_runs: dict[int, list[float]] = {1: [], 2: []}  # decode at --decode-context
    threads = torch.get_num_threads()
    for r in range(args.rounds):
        for key in (1, 2, 0):
            torch.set_num_threads(1 if key == 0 else threads)
            pp = max(key, 1)
            backend = args.backend if pp > 1 else "shm"
            p = prefill(pp, args.prompt_len, args.chunk, backend)
            d = decode(pp, 16, 32, 64, backend)
            runs[key].append({**p, **d})
            print(f"round {r} run {key}: TTFT {p['ttft_s']:.2f} s, decode {d['tok_s']:.1f} tok/s", file=sys.stderr)
            if key == 2 and args.decode_split:
                split_runs.append(decode(2, 16, 32, 64, backend, args.decode_split)["tok_s"])
                print(f"round {r} PP=2 split {args.decode_split}: decode {split_runs[-1]:.1f} tok/s", file=sys.stderr)
            if key and args.decode_context:
                long_runs[key].append(decode(pp, 16, args.decode_context, 64, backend,
                                             args.decode_split if pp > 1 else None)["tok_s"])
                print(f"round {r} run {key}: decode at {args.decode_context} tokens {long_runs[key][-1]:.1f} tok/s",
                      file=sys.stderr)
    torch.set_num_threads(threads)
    med = {key: {k: statistics.median(x[k] for x in rs) for k in ("ttft_s", "tok_s")} for key, rs in runs.items()}
    one, two = runs[1][0], runs[2][0]
    itemsize = torch.tensor([], dtype=getattr(torch, one["dtype"])).element_size()
    n = -(-args.prompt_len // args.chunk)
    bubble = 1 - med[1]["ttft_s"] / med[2]["ttft_s"]
    bubble_1t = 1 - med[0]["ttft_s"] / 2 / med[2]["ttft_s"]  # against half the single-thread work
    load = os.getloadavg()[0]
    isa = "avx512_bf16" if "avx512_bf16" in open("/proc/cpuinfo").read() else "avx2"
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    lines = [
        args.section, "",
        f"SmolLM2-135M-Instruct, {one['dtype']}, PP=1 on 2 threads against PP=2 on 1 thread per rank "
        f"(hand-offs: tp_backend {args.backend}) "
        f"(median of {args.rounds} interleaved rounds; every round's figures below the table):", "",
        "| figure | PP=1 | PP=2 | PP=2 / PP=1 |", "|---|---:|---:|---:|",
        f"| TTFT, one {args.prompt_len}-token prompt in {n} chunks of {args.chunk} (s) | {med[1]['ttft_s']:.2f} | "
        f"{med[2]['ttft_s']:.2f} | {med[2]['ttft_s'] / med[1]['ttft_s']:.2f}x |",
        f"| decode, 16 streams (tokens/s) | {med[1]['tok_s']:.1f} | {med[2]['tok_s']:.1f} | "
        f"{med[2]['tok_s'] / med[1]['tok_s']:.2f}x |",
        *([f"| decode, 16 streams, PP=2 split {args.decode_split} (tokens/s) | {med[1]['tok_s']:.1f} | "
           f"{statistics.median(split_runs):.1f} | {statistics.median(split_runs) / med[1]['tok_s']:.2f}x |"]
          if split_runs else []),
        *([f"| decode, 16 streams of {args.decode_context}-token prompts"
           + (f", PP=2 split {args.decode_split}" if args.decode_split else "")
           + f" (tokens/s) | {statistics.median(long_runs[1]):.1f} | {statistics.median(long_runs[2]):.1f} | "
           f"{statistics.median(long_runs[2]) / statistics.median(long_runs[1]):.2f}x |"]
          if args.decode_context else []), "",
        f"Control, PP=1 on 1 thread: TTFT {med[0]['ttft_s']:.2f} s, decode {med[0]['tok_s']:.1f} tokens/s.", "",
        f"Bytes handed from stage 0 to stage 1 per token: measured {two['bytes_per_token']:.0f}; theory "
        f"hidden_size x {one['dtype']} = {one['hidden']} x {itemsize} B = {one['hidden'] * itemsize} "
        "(the residual stream only; the last stage returns to rank 0 a token id, 4 B, per sampled row "
        "of a batch whose every sampler is plain greedy, as here, and the rows' logits, vocab x 4 B "
        "each, otherwise).", "",
        f"Bubble left in the pipelined prefill: {bubble:.0%} of the two cores' time "
        f"(1 - T(PP=1) / T(PP=2)); against the 1-thread control, 1 - (T(PP=1, 1 thread) / 2) / T(PP=2) = "
        f"{bubble_1t:.0%}; the pipeline's own with {n} chunks on 2 stages: 1 / {n + 1} = {1 / (n + 1):.0%}.",
        "", "Every round, TTFT s / decode tok/s (PP=1 2 threads | PP=2 | PP=1 1 thread): " + "; ".join(
            f"{a['ttft_s']:.2f} / {a['tok_s']:.1f} | {b['ttft_s']:.2f} / {b['tok_s']:.1f} | "
            f"{c['ttft_s']:.2f} / {c['tok_s']:.1f}" for a, b, c in zip(runs[1], runs[2], runs[0]))
        + (f"; PP=2 split {args.decode_split} decode tok/s by round: " + ", ".join(f"{x:.1f}" for x in split_runs)
           if split_runs else "")
        + (f"; decode at {args.decode_context} tokens, PP=1 | PP=2, by round: " + ", ".join(
            f"{a:.1f} | {b:.1f}" for a, b in zip(long_runs[1], long_runs[2])) if args.decode_context else ""), "",
        "- Command: `python -m engine.parallel.pp_bench " + shlex.join(argv if argv is not None else sys.argv[1:]) + "`",
        f"- Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        f"- Machine: `nproc` {os.cpu_count()}, {cpu}, ISA `{isa}`, torch {torch.__version__}, "
        f"Python {platform.python_version()}, load average {load:.1f} when it finished",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.write:
        from engine.benchmarks_md import write_section

        write_section(text)
        print(f"wrote the '{args.section}' section", file=sys.stderr)


if __name__ == "__main__":
    main()
