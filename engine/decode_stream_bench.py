"""bf16 decode: how a thread streams its weights, each way side by side on this machine.

    python -m engine.decode_stream_bench
    python -m engine.decode_stream_bench --isa avx512bf16,avx2 --threads 1,2 --rounds 5 --write

A bf16 matmul of decode rows (one register tile a block of 32 columns) can stream a matrix in
several ways (engine/csrc/matmul_bf16.cpp, `set_bf16_decode_stream`): each thread takes its blocks
as one run of consecutive blocks (the default) or claims them in four chunks in turn, and each
block's tile fetches into L2 in software nothing, the block its thread runs next (by default in
matmuls of at least a number of rows each ISA path sets, the one each setting's label names; or at
any rows), and below those rows nothing or its own stream a fixed distance ahead (the avx2 path's
default 1 KiB, or `--ahead`, bytes; past a matrix's end that is the next matrix the step reads).
Every setting computes the same bits; which is fastest depends on the CPU's memory path and on the
rows. One model, every setting, in interleaved rounds of decode (a 128-token prompt and 128 new
tokens by default; `--batch 1,4` also times 4 sequences decoded together: up to one register tile of
rows, 6 on avx2 and 12 on AVX-512, they take the same setting), each round's ratios taken within the
round: these machines are shared and noisy. Each round starts one setting further on. The memory
wall is the step's weight bytes at the read bandwidth measured in the same run.
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
    prefetch_next_from: int  # rows (0: never)
    prefetch_ahead: int = 0  # bytes

    def apply(self, ext) -> None:
        ext.set_bf16_decode_stream(self.chunks_per_thread, self.prefetch_next_from, self.prefetch_ahead)


DEFAULT_AHEAD = (1024, 4096, 16384)


def settings(default: tuple[int, int, int], ahead: tuple[int, ...] = DEFAULT_AHEAD) -> tuple[Setting, ...]:
    """The ISA path's default first (`default_bf16_decode_stream()`): the ratios are to it. The
    distances are tried where the own-stream prefetch applies, below the rows the next block is
    fetched from (at one row on every path)."""
    chunks, start, own = default

    def below(a: int) -> str:
        return f", {a / 1024:g} KiB ahead below" if a else ", nothing ahead below"

    return (Setting(f"default: one run a thread, next block from {start} rows{below(own)}", chunks, start, own),
            Setting("4 chunks a thread", 4, start, own),
            Setting("one run, no prefetch", 1, 0),
            Setting("one run, next block at any rows", 1, 1),
            *(Setting(f"one run, next block from {start} rows{below(a)}", 1, start, a)
              for a in (0, *ahead) if a != own))


def load(model: str | None, isa: str):
    from engine.llm import LLM
    from engine.weights import resolve_model

    return LLM(str(resolve_model(model)), dtype="bfloat16", enable_prefix_caching=False, kernel_isa=isa)


def batch_decode_tok_s(outs) -> float:
    """Decode rate of sequences generated together to the same length: every token after the last
    one's first, over the time all of them decoded together (one row each a step)."""
    start = max(o.metrics["ttft"] for o in outs)
    return len(outs) * (len(outs[0].token_ids) - 1) / (max(o.metrics["e2e"] for o in outs) - start)


def run(model: str | None, isas: list[str], threads: list[int], rounds: int, prompt_len: int, new: int,
        ahead: tuple[int, ...] = DEFAULT_AHEAD, batches: tuple[int, ...] = (1,)) -> str:
    import torch

    from engine.bench import _kv_params, make_prompts, step_weight_bytes
    from engine.kernels import load_native_ops
    from engine.kscale_bench import read_gb_s

    rows = []
    for isa in isas:
        ext = load_native_ops(isa)
        if ext is None:
            raise SystemExit(f"--isa {isa}: this CPU does not run it (or it did not build)")
        all_settings = settings(ext.default_bf16_decode_stream(), ahead)
        llm = load(model, isa)
        mb = step_weight_bytes(llm.core.model) / 1e6
        prompt = make_prompts(1, prompt_len, llm.model_config.vocab_size)[0]
        tokens = set()
        try:
            for s in all_settings:
                s.apply(ext)
                tokens.add(tuple(llm.generate(prompt, _kv_params(32))[0].token_ids))
            if len(tokens) != 1:
                raise SystemExit(f"{isa}: the settings gave different greedy tokens; they must compute the same bits")
            for t in threads:
                torch.set_num_threads(t)
                wall = read_gb_s()
                for b in batches:
                    seqs = [prompt] + make_prompts(b - 1, prompt_len, llm.model_config.vocab_size, seed=1)
                    tok = {s: [] for s in all_settings}
                    for r in range(rounds):
                        # Each round starts one setting further on, so no setting always follows the
                        # same one (running right after a slow setting can lift or sink a figure).
                        k = r % len(all_settings)
                        for s in all_settings[k:] + all_settings[:k]:
                            s.apply(ext)
                            llm.generate(seqs, _kv_params(8))
                            tok[s].append(batch_decode_tok_s(llm.generate(seqs, _kv_params(new))))
                            assert llm.core.pool.is_fully_free()
                        print(f"{isa} {t} thread(s) {b} row(s) round {r + 1}/{rounds}: "
                              + ", ".join(f"{s.label} {v[-1]:.1f}" for s, v in tok.items()) + " tok/s",
                              file=sys.stderr)
                    base = tok[all_settings[0]]
                    for s in all_settings:
                        ratios = [a / b for a, b in zip(tok[s], base)]
                        med = statistics.median(tok[s])
                        rows.append(f"| {isa} | {t} | {b} | {s.label} | {med:.1f} | "
                                    f"{100 * med / b * mb / 1e3 / wall:.0f}% "
                                    f"| {', '.join(f'{x:.2f}' for x in ratios)} | **{statistics.median(ratios):.2f}x** |")
        finally:
            all_settings[0].apply(ext)
        del llm
    return (f"Bytes read per decode step: {mb:.4g} MB. Greedy tokens: the same under every setting (checked).\n\n"
            "Rows: sequences decoded together, a row each a step; tokens/s counts them all, and the wall's share is a\n"
            "step's (the weights are read once a step, whatever the rows).\n\n"
            "| ISA path | threads | rows | setting | tokens/s | of the wall | / default, each round | median |\n"
            "|---|---:|---:|---|---:|---:|---|---:|\n" + "\n".join(rows) + "\n")


def main(argv: list[str] | None = None) -> int:
    from engine.benchmarks_md import command_line, comma_list, cpu_isa_text, provenance, publish, side_by_side_parser

    p = side_by_side_parser("engine.decode_stream_bench", __doc__, SECTION)
    p.add_argument("--model", default=None, help="checkpoint folder or .gguf (default: SmolLM2-135M-Instruct)")
    p.add_argument("--ahead", default=",".join(map(str, DEFAULT_AHEAD)),
                   help="prefetch distances to compare, bytes, comma-separated (multiples of 64, up to 1 MiB; "
                        "empty: none)")
    p.add_argument("--batch", default="1",
                   help="sequences decoded together, comma-separated (1 to 12: the rows one register tile takes)")
    args = p.parse_args(argv)
    isas, threads, ahead = comma_list(args.isa), comma_list(args.threads, int), tuple(comma_list(args.ahead, int))
    batches = tuple(comma_list(args.batch, int))
    if not batches or any(not 1 <= b <= 12 for b in batches):
        raise SystemExit(f"--batch {args.batch}: each batch must be 1 to 12 sequences (the rows a decode tile takes)")
    bad = [a for a in ahead if not (0 < a <= 1 << 20 and a % 64 == 0)]
    if bad:
        raise SystemExit(f"--ahead {bad[0]}: a prefetch distance must be a multiple of 64 bytes from 64 to 1048576")
    if not isas:
        raise SystemExit("no kernel ISA path to run: this CPU runs none (see engine/kernels.py)")
    body = run(args.model, isas, threads, args.rounds, args.prompt_len, args.new_tokens, ahead, batches)
    command = command_line("engine.decode_stream_bench", argv)
    text = (f"{args.section}\n\nWritten by `engine/decode_stream_bench.py`. bf16 decode, "
            f"{' and '.join(map(str, batches))} sequence(s) at once ({args.prompt_len}-token prompts, "
            f"{args.new_tokens} new), of {args.model or 'the default model'}, "
            "every setting in one process, interleaved rounds (each starting one setting further on); "
            f"the CPU runs {cpu_isa_text()}.\n\n{body}\n"
            f"{provenance(command)}\n")
    return publish(text, args.write)


if __name__ == "__main__":
    raise SystemExit(main())
