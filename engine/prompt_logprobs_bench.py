"""What the prompt's logprobs cost: time to first token with and without them, side by side.

    python -m engine.prompt_logprobs_bench
    python -m engine.prompt_logprobs_bench --prompt-lens 128,512,2000 --top 0,5 --rounds 5 --write
    python -m engine.prompt_logprobs_bench --layouts 1x1,2x1,1x2 --write --section '## ...'

Scoring a prompt (`SamplingParams.prompt_logprobs`, what lm-evaluation-harness asks a server for) runs
the LM head on every prompt position instead of the last one only, then a log-softmax over the
vocabulary and, with top alternatives, a top-k per position (engine.runner.score_rows). On a replica
of several ranks (``--layouts`` TPxPP) each tensor-parallel rank runs its slice of the LM head and
rank 0 reduces the gathered logits; with pipeline parallelism the last stage reduces them and
returns each position's logprob, rank and top k.
One model (prefix cache off, so every run computes its whole prompt), every setting on the same random
prompt in interleaved rounds, each round starting one setting further on; ratios are taken within a
round: these machines are shared and noisy. The extra LM-head work is (prompt tokens - 1) x vocabulary
x hidden multiply-adds, set beside the prompt's own forward pass (2 x parameters x tokens FLOPs).
"""
from __future__ import annotations

import statistics

SECTION = "## The prompt's logprobs: what scoring a prompt costs"


def layer_macs(cfg) -> int:
    """Multiply-adds per token of a dense model's layers' matmuls (attention's own not counted)."""
    qkv = cfg.hidden_size * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    return cfg.num_layers * (qkv + cfg.num_heads * cfg.head_dim * cfg.hidden_size + 3 * cfg.hidden_size *
                             cfg.intermediate_size)


def run(model: str | None, lengths: list[int], tops: list[int], rounds: int,
        layouts: list[tuple[int, int]] = ((1, 1),)) -> str:
    import torch

    from engine.bench import isa_label, make_prompts
    from engine.llm import LLM
    from engine.sampling import SamplingParams
    from engine.weights import resolve_model

    settings = [("without", None), *((f"prompt_logprobs={k}", k) for k in tops)]
    lines = []
    for tp, pp in layouts:
        with LLM(str(resolve_model(model)), enable_prefix_caching=False, num_kv_blocks=512,
                 tensor_parallel_size=tp, pipeline_parallel_size=pp) as llm:
            cfg = llm.model_config
            if not lines:
                lines = [f"Model: {cfg.num_layers} layers, hidden {cfg.hidden_size}, vocabulary {cfg.vocab_size}; "
                         f"dtype {llm.core.model.dtype}, kernel path {isa_label(llm)}, {torch.get_num_threads()} "
                         "threads (a replica of several ranks: the cores shared among them).", "",
                         "| TP x PP | prompt tokens | setting | time to first token, ms | / without, each round "
                         "| median |", "|---|---:|---|---:|---|---:|"]
            for length in lengths:
                prompt = make_prompts(1, length, cfg.vocab_size, seed=length)[0]
                times: dict[str, list[float]] = {name: [] for name, _ in settings}
                for name, k in settings:  # warm up every shape once
                    llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=k))
                for r in range(rounds):
                    for i in range(len(settings)):
                        name, k = settings[(i + r) % len(settings)]
                        out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0,
                                                                    prompt_logprobs=k))[0]
                        assert k is None or len(out.prompt_logprobs) == length
                        times[name].append(out.metrics["ttft"])
                base = times["without"]
                for name, _ in settings:
                    ratios = [t / b for t, b in zip(times[name], base)]
                    lines.append(f"| {tp} x {pp} | {length} | {name} | {statistics.median(times[name]) * 1e3:.1f} | "
                                 f"{', '.join(f'{x:.2f}' for x in ratios)} | **{statistics.median(ratios):.2f}x** |")
    if not cfg.is_moe:
        lines += ["", "What bounds it: the extra LM-head multiply-adds, against the layers' matmuls the prompt runs "
                  "through anyway (attention not counted):", ""]
        for length in lengths:
            extra, own = (length - 1) * cfg.vocab_size * cfg.hidden_size, length * layer_macs(cfg)
            lines.append(f"- {length} tokens: {extra / 1e9:.2f} G beside {own / 1e9:.1f} G ({extra / own:.0%})")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    import argparse

    from engine.benchmarks_md import add_output_arguments, command_line, comma_list, cpu_isa_text, provenance, publish

    p = argparse.ArgumentParser(prog="python -m engine.prompt_logprobs_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint folder or .gguf (default: SmolLM2-135M-Instruct)")
    p.add_argument("--prompt-lens", default="128,512,2000", help="prompt lengths, comma-separated")
    p.add_argument("--top", default="0,5", help="top alternatives per position to compare, comma-separated")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--layouts", default="1x1", help="replica layouts to run, TPxPP, comma-separated (e.g. 1x1,2x1,1x2)")
    add_output_arguments(p, SECTION)
    args = p.parse_args(argv)
    lengths, tops = comma_list(args.prompt_lens, int), comma_list(args.top, int)
    if not lengths or any(n < 2 for n in lengths):
        raise SystemExit(f"--prompt-lens {args.prompt_lens}: each prompt needs at least 2 tokens to score")
    if any(not 0 <= k <= 20 for k in tops):
        raise SystemExit(f"--top {args.top}: each must be 0 to 20")
    try:
        layouts = [tuple(int(n) for n in lay.split("x")) for lay in comma_list(args.layouts, str)]
    except ValueError:
        layouts = []
    if not layouts or any(len(lay) != 2 or min(lay) < 1 for lay in layouts):
        raise SystemExit(f"--layouts {args.layouts}: each must be TPxPP, e.g. 2x1")
    body = run(args.model, lengths, tops, args.rounds, layouts)
    text = (f"{args.section}\n\nWritten by `engine/prompt_logprobs_bench.py`: time to first token of one prompt "
            f"(1 new token) with and without its logprobs, {args.model or 'the default model'}, prefix cache off, "
            f"interleaved rounds in one process; the CPU runs {cpu_isa_text()}.\n\n{body}\n"
            f"{provenance(command_line('engine.prompt_logprobs_bench', argv))}\n")
    return publish(text, args.write)


if __name__ == "__main__":
    raise SystemExit(main())
