"""bf16 decode: how a thread streams its weights, each way side by side on this machine.

    python -m engine.decode_stream_bench
    python -m engine.decode_stream_bench --isa avx512bf16,avx2 --threads 1,2 --rounds 5 --write

A bf16 matmul of decode rows (one register tile a block of 32 columns) can stream a matrix in
four ways (engine/csrc/matmul_bf16.cpp, `set_bf16_decode_stream`): each thread takes its blocks
as one run of consecutive blocks (the default) or claims them in four chunks in turn, and each
block's tile does or does not also fetch the block the thread runs next into L2. All four compute
the same bits; which is fastest depends on the CPU's memory path. One model,
every setting, in interleaved rounds of single-stream decode (a 128-token prompt and 128 new
tokens by default), each round's ratios taken within the round: these machines are shared and
noisy. The memory wall is the step's weight bytes at the read bandwidth measured in the same run.
"""
from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass

SECTION = "## bf16 decode: how a thread streams its weights"


@dataclass(frozen=True)
class Setting:
    label: str
    chunks_per_thread: int
    prefetch_next: bool


SETTINGS = (  # the default first: the ratios are to it
    Setting("one run a thread (default)", 1, False),
    Setting("4 chunks a thread", 4, False),
    Setting("one run, next block prefetched", 1, True),
    Setting("4 chunks, next block prefetched", 4, True),
)


def load(model: str | None, isa: str):
    from engine.llm import LLM
    from engine.weights import resolve_model

    return LLM(str(resolve_model(model)), dtype="bfloat16", enable_prefix_caching=False, kernel_isa=isa)


def run(model: str | None, isas: list[str], threads: list[int], rounds: int, prompt_len: int, new: int) -> str:
    import torch

    from engine.bench import _kv_params, decode_tok_s, make_prompts, step_weight_bytes
    from engine.kernels import load_native_ops
    from engine.kscale_bench import read_gb_s

    rows = []
    for isa in isas:
        ext = load_native_ops(isa)
        if ext is None:
            raise SystemExit(f"--isa {isa}: this CPU does not run it (or it did not build)")
        llm = load(model, isa)
        mb = step_weight_bytes(llm.core.model) / 1e6
        prompt = make_prompts(1, prompt_len, llm.model_config.vocab_size)[0]
        tokens = set()
        try:
            for s in SETTINGS:
                ext.set_bf16_decode_stream(s.chunks_per_thread, s.prefetch_next)
                tokens.add(tuple(llm.generate(prompt, _kv_params(32))[0].token_ids))
            if len(tokens) != 1:
                raise SystemExit(f"{isa}: the settings gave different greedy tokens; they must compute the same bits")
            for t in threads:
                torch.set_num_threads(t)
                wall = read_gb_s()
                tok = {s: [] for s in SETTINGS}
                for r in range(rounds):
                    for s in SETTINGS:
                        ext.set_bf16_decode_stream(s.chunks_per_thread, s.prefetch_next)
                        llm.generate(prompt, _kv_params(8))
                        tok[s].append(decode_tok_s(llm.generate(prompt, _kv_params(new))[0]))
                        assert llm.core.pool.is_fully_free()
                    print(f"{isa} {t} thread(s) round {r + 1}/{rounds}: "
                          + ", ".join(f"{s.label} {v[-1]:.1f}" for s, v in tok.items()) + " tok/s", file=sys.stderr)
                base = tok[SETTINGS[0]]
                for s in SETTINGS:
                    ratios = [a / b for a, b in zip(tok[s], base)]
                    med = statistics.median(tok[s])
                    rows.append(f"| {isa} | {t} | {s.label} | {med:.1f} | {100 * med * mb / 1e3 / wall:.0f}% "
                                f"| {', '.join(f'{x:.2f}' for x in ratios)} | **{statistics.median(ratios):.2f}x** |")
        finally:
            ext.set_bf16_decode_stream(SETTINGS[0].chunks_per_thread, SETTINGS[0].prefetch_next)
        del llm
    return (f"Bytes read per decode step: {mb:.4g} MB. Greedy tokens: the same under every setting (checked).\n\n"
            "| ISA path | threads | setting | tokens/s | of the wall | / default, each round | median |\n"
            "|---|---:|---|---:|---:|---|---:|\n" + "\n".join(rows) + "\n")


def main(argv: list[str] | None = None) -> int:
    from engine.benchmarks_md import command_line, comma_list, cpu_isa_text, provenance, publish, side_by_side_parser

    p = side_by_side_parser("engine.decode_stream_bench", __doc__, SECTION)
    p.add_argument("--model", default=None, help="checkpoint folder or .gguf (default: SmolLM2-135M-Instruct)")
    args = p.parse_args(argv)
    isas, threads = comma_list(args.isa), comma_list(args.threads, int)
    if not isas:
        raise SystemExit("no kernel ISA path to run: this CPU runs none (see engine/kernels.py)")
    body = run(args.model, isas, threads, args.rounds, args.prompt_len, args.new_tokens)
    command = command_line("engine.decode_stream_bench", argv)
    text = (f"{SECTION}\n\nWritten by `engine/decode_stream_bench.py`. Single-stream bf16 decode "
            f"({args.prompt_len}-token prompt, {args.new_tokens} new) of {args.model or 'the default model'}, "
            f"every setting in one process, interleaved rounds; the CPU runs {cpu_isa_text()}.\n\n{body}\n"
            f"{provenance(command)}\n")
    return publish(text, args.write)


if __name__ == "__main__":
    raise SystemExit(main())
