"""5-bit GGUF codes held as bytes or at 5 bits (KVRELAY_GGUF_FIVE_BIT), side by side.

    python -m engine.five_bit_bench                       # the default model in llama.cpp's Q4_K_M layout
    python -m engine.five_bit_bench --threads 1,2 --isa avx512bf16,avx2 --rounds 5 --write

Both forms of one file are loaded in one process and timed in interleaved rounds (single-stream
decode, by default of a 128-token prompt and 128 new tokens), each round's ratio taken within the round: these
machines are shared and noisy. The file defaults to the packaged Q4_1 model rewritten by
`engine.kquants` with llama.cpp's Q4_K_M types (mostly Q5_0 at SmolLM2's rows of 576).
"""
from __future__ import annotations

import os
import statistics
import sys
import tempfile
from pathlib import Path
from unittest import mock

SECTION = "## 5-bit GGUF codes: held as bytes or at 5 bits"
FORMS = ("widen", "keep")


def load(path: Path, isa: str, form: str):
    from engine.llm import LLM
    from engine.gguf_blocks import FIVE_BIT_ENV

    with mock.patch.dict(os.environ, {FIVE_BIT_ENV: form}):
        return LLM(str(path), dtype="float32", enable_prefix_caching=False, kernel_isa=isa, quantization="gguf")


def run(path: Path, isas: list[str], threads: list[int], rounds: int, prompt_len: int, new: int) -> str:
    import torch

    from engine.bench import _kv_params, decode_tok_s, make_prompts, step_weight_bytes

    rows = []
    for isa in isas:
        llms = {f: load(path, isa, f) for f in FORMS}
        prompt = make_prompts(1, prompt_len, llms["widen"].model_config.vocab_size)[0]
        same = len({tuple(l.generate(prompt, _kv_params(32))[0].token_ids) for l in llms.values()}) == 1
        for t in threads:
            torch.set_num_threads(t)
            tok = {f: [] for f in FORMS}
            for r in range(rounds):
                for f, llm in llms.items():
                    llm.generate(prompt, _kv_params(8))
                    tok[f].append(decode_tok_s(llm.generate(prompt, _kv_params(new))[0]))
                    assert llm.core.pool.is_fully_free()
                print(f"{isa} {t} thread(s) round {r + 1}/{rounds}: "
                      + ", ".join(f"{f} {v[-1]:.1f} tok/s" for f, v in tok.items()), file=sys.stderr)
            ratios = [k / w for k, w in zip(tok["keep"], tok["widen"])]
            rows.append(f"| {isa} | {t} | {statistics.median(tok['widen']):.1f} | {statistics.median(tok['keep']):.1f} "
                        f"| {', '.join(f'{x:.2f}' for x in ratios)} | **{statistics.median(ratios):.2f}x** "
                        f"| {'yes' if same else 'NO'} |")
        mb = {f: step_weight_bytes(llm.core.model) / 1e6 for f, llm in llms.items()}
        del llms
    return (f"Bytes read per decode step: {mb['widen']:.4g} MB held as bytes (widen, the default), "
            f"{mb['keep']:.4g} MB at 5 bits (keep).\n\n"
            "| ISA path | threads | bytes: tokens/s | 5-bit: tokens/s | 5-bit / bytes, each round | median "
            "| same greedy tokens |\n|---|---:|---:|---:|---|---:|---|\n" + "\n".join(rows) + "\n")


def main(argv: list[str] | None = None) -> int:
    from engine.benchmarks_md import command_line, comma_list, cpu_isa_text, provenance, publish, side_by_side_parser

    p = side_by_side_parser("engine.five_bit_bench", __doc__, SECTION)
    p.add_argument("--model", type=Path, help="a GGUF file (default: the packaged model rewritten as Q4_K_M)")
    args = p.parse_args(argv)
    isas, threads = comma_list(args.isa), comma_list(args.threads, int)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model
        if path is None:
            from engine.kquants import requantize_gguf
            from engine.weights import default_gguf_path

            path = Path(tmp) / "smollm2-q4_k_m.gguf"
            counts = requantize_gguf(default_gguf_path(), path)
            print(f"the default model as Q4_K_M: {counts}", file=sys.stderr)
        body = run(path, isas, threads, args.rounds, args.prompt_len, args.new_tokens)
    what = "the default model in llama.cpp's Q4_K_M layout" if args.model is None else args.model.name
    command = command_line("engine.five_bit_bench", argv)
    text = (f"{args.section}\n\nWritten by `engine/five_bit_bench.py`. Single-stream decode "
            f"({args.prompt_len}-token prompt, {args.new_tokens} new) of {what}, "
            f"both forms in one process, interleaved rounds; the CPU runs {cpu_isa_text()}.\n\n{body}\n"
            f"{provenance(command)}\n")
    return publish(text, args.write)


if __name__ == "__main__":
    raise SystemExit(main())
