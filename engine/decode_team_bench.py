"""Single-stream decode on several threads: a fused step run as one team, against each op forking
and joining its threads, side by side on this machine.

    python -m engine.decode_team_bench
    python -m engine.decode_team_bench --quantization none,gguf --threads 2 --rounds 9 --write

A fused decode step of several threads runs as one team (engine/csrc/ops.h Team): one OpenMP
region for the whole step, each thread a share of every matmul's blocks and of attention's items,
barriers only where one thread reads what another wrote, and a thread that reaches a barrier
first fetches the start of its share of the next weight matrix meanwhile (`--fetch`, bytes; the
default 64 KiB). Against it: the same kernels with one fork and join per op
(`set_decode_team(False)`). Every setting computes the same bits (checked on greedy tokens and on
a step's hidden states). For each weight format and thread count, in interleaved rounds (each
starting one setting further on, ratios taken within a round: these machines are shared and
noisy): the fused step alone (one captured step of the 128-token prompt, replayed), and whole
generates (decode tokens/s). The memory wall is a step's weight bytes at the read bandwidth
measured in the same run.
"""
from __future__ import annotations

import statistics
import sys
import time

SECTION = "## Single-stream decode on several threads: one team a step"
DEFAULT_FETCH = (0, 16384)  # besides the module's default (64 KiB)


def settings(default_fetch: int, fetch: tuple[int, ...]) -> list[tuple[str, bool, int]]:
    """(label, team, fetch bytes): the per-op joins first (the ratios are to them), then the team's
    default, then the team with each other fetch."""
    def label(f: int) -> str:
        return f"team, {f / 1024:g} KiB of the next matrix fetched at a barrier" if f else "team, nothing fetched"

    return ([("a fork and join per op", False, 0), (label(default_fetch) + " (default)", True, default_fetch)]
            + [(label(f), True, f) for f in fetch if f != default_fetch])


def _captured_step(llm, prompt):
    """The arguments of one single-stream fused step of a real generate (the last thread count dropped)."""
    from engine.bench import _kv_params

    model = llm.core.model
    fused, seen = model.fused, []

    class Capture:
        def forward(self, *a):
            if a[0].shape[0] == 1 and not seen:
                seen.append(a[:-1])
            return fused.forward(*a)

    model.fused = Capture()
    try:
        llm.generate(prompt, _kv_params(4))
    finally:
        model.fused = fused
    return fused, seen[0]


def run(model: str | None, quants: list[str], isas: list[str], threads: list[int], rounds: int, prompt_len: int,
        new: int, fetch: tuple[int, ...]) -> str:
    import torch

    from engine.bench import _kv_params, decode_tok_s, make_prompts, step_weight_bytes
    from engine.kernels import load_native_ops
    from engine.kscale_bench import read_gb_s
    from engine.llm import LLM
    from engine.weights import resolve_model

    rows = []
    for isa in isas:
        ext = load_native_ops(isa)
        if ext is None:
            raise SystemExit(f"--isa {isa}: this CPU does not run it (or it did not build)")
        before = ext.decode_team()
        all_settings = settings(before[1], fetch)
        for quant in quants:
            llm = LLM(str(resolve_model(model)), dtype="bfloat16" if quant == "none" else "float32",
                      quantization=quant, enable_prefix_caching=False, kernel_isa=isa)
            mb = step_weight_bytes(llm.core.model) / 1e6
            prompt = make_prompts(1, prompt_len, llm.model_config.vocab_size)[0]
            fused, step = _captured_step(llm, prompt)
            if fused is None:
                raise SystemExit(f"{quant} on {isa}: this model takes no fused decode step")
            try:
                for t in threads:
                    torch.set_num_threads(t)
                    hidden, tokens = set(), set()
                    for _, team, f in all_settings:  # (the steps first: a generate writes over the step's cache)
                        ext.set_decode_team(team, f)
                        hidden.add(fused.forward(*step, t).float().numpy().tobytes())
                    for _, team, f in all_settings:
                        ext.set_decode_team(team, f)
                        tokens.add(tuple(llm.generate(prompt, _kv_params(32))[0].token_ids))
                    if len(hidden) != 1 or len(tokens) != 1:
                        raise SystemExit(f"{quant} {isa} {t} threads: the settings computed different bits")
                    wall = read_gb_s()
                    step_ms = {s: [] for s in all_settings}
                    tok = {s: [] for s in all_settings}
                    for r in range(rounds):
                        k = r % len(all_settings)
                        for s in all_settings[k:] + all_settings[:k]:
                            ext.set_decode_team(s[1], s[2])
                            fused.forward(*step, t)
                            t0 = time.perf_counter()
                            for _ in range(20):
                                fused.forward(*step, t)
                            step_ms[s].append((time.perf_counter() - t0) / 20 * 1e3)
                            tok[s].append(decode_tok_s(llm.generate(prompt, _kv_params(new))[0]))
                            assert llm.core.pool.is_fully_free()
                        print(f"{quant} {isa} {t} thread(s) round {r + 1}/{rounds}: "
                              + ", ".join(f"{s[0]} {v[-1]:.1f}" for s, v in tok.items()) + " tok/s", file=sys.stderr)
                    base = all_settings[0]
                    for s in all_settings:
                        step_x = statistics.median(b / a for a, b in zip(step_ms[s], step_ms[base]))
                        tok_x = [a / b for a, b in zip(tok[s], tok[base])]
                        med = statistics.median(tok[s])
                        rows.append(f"| {quant} | {isa} | {t} | {s[0]} | {statistics.median(step_ms[s]):.2f} | "
                                    f"{step_x:.2f}x | {med:.1f} | {100 * med * mb / 1e3 / wall:.0f}% | "
                                    f"{', '.join(f'{x:.2f}' for x in tok_x)} | **{statistics.median(tok_x):.2f}x** |")
            finally:
                ext.set_decode_team(*before)
            del llm
    return ("Same bits under every setting (checked: a step's hidden states and 32 greedy tokens).\n\n"
            "| weights | ISA path | threads | setting | fused step, ms | step: joins / this | decode tokens/s "
            "| of the wall | tokens/s / joins, each round | median |\n"
            "|---|---|---:|---|---:|---:|---:|---:|---|---:|\n" + "\n".join(rows) + "\n")


def main(argv: list[str] | None = None) -> int:
    from engine.bench import _quant_list
    from engine.benchmarks_md import command_line, comma_list, cpu_isa_text, provenance, publish, side_by_side_parser

    p = side_by_side_parser("engine.decode_team_bench", __doc__, SECTION)
    p.set_defaults(threads="2")
    p.add_argument("--model", default=None, help="checkpoint folder or .gguf (default: SmolLM2-135M-Instruct)")
    p.add_argument("--quantization", type=_quant_list, default=["none"], metavar="Q[,Q...]",
                   help="weight formats, comma-separated: none (bf16), gguf, int8")
    p.add_argument("--fetch", default=",".join(map(str, DEFAULT_FETCH)),
                   help="other bytes of the next matrix to fetch at a barrier, comma-separated (multiples of 64 "
                        "up to 1 MiB)")
    args = p.parse_args(argv)
    isas, threads, fetch = comma_list(args.isa), comma_list(args.threads, int), tuple(comma_list(args.fetch, int))
    bad = [f for f in fetch if not (0 <= f <= 1 << 20 and f % 64 == 0)]
    if bad:
        raise SystemExit(f"--fetch {bad[0]}: must be a multiple of 64 bytes from 0 to 1048576")
    if not isas:
        raise SystemExit("no kernel ISA path to run: this CPU runs none (see engine/kernels.py)")
    if any(t < 2 for t in threads):
        raise SystemExit(f"--threads {args.threads}: a team needs 2 threads or more")
    body = run(args.model, args.quantization, isas, threads, args.rounds, args.prompt_len, args.new_tokens, fetch)
    command = command_line("engine.decode_team_bench", argv)
    text = (f"{args.section}\n\nWritten by `engine/decode_team_bench.py`. Single-stream decode "
            f"({args.prompt_len}-token prompt, {args.new_tokens} new) of {args.model or 'the default model'}, "
            f"every setting in one process, {args.rounds} interleaved rounds; the CPU runs {cpu_isa_text()}.\n\n"
            f"{body}\n{provenance(command)}\n")
    return publish(text, args.write)


if __name__ == "__main__":
    raise SystemExit(main())
