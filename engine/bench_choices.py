"""What n > 1's fork and the penalties cost, offline (engine.LLM, the default model):

    python -m engine.bench_choices [--prompt-tokens 512] [--n 4] [--max-tokens 32]

1. n choices of one prompt as a fork (the prompt's full blocks computed once
   and shared) against n separate requests of the same prompt, prefix cache
   off (what the frontend did before the fork), side by side: wall time and
   the prompt tokens computed.
2. Single-stream decode with presence + frequency + repetition penalties and
   a logit_bias against plain decode: tokens per second.
"""
from __future__ import annotations

import argparse
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    from engine.llm import LLM
    from engine.sampling import SamplingParams
    from engine.weights import resolve_model

    llm = LLM(str(resolve_model(None)), enable_prefix_caching=False, num_kv_blocks=512)
    prompt = [(i * 7919) % 40000 + 100 for i in range(args.prompt_tokens)]
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    llm.generate([prompt], greedy)  # warm-up

    def run(fn) -> tuple[float, int]:
        best, computed = float("inf"), 0
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            outs = fn()
            best = min(best, time.perf_counter() - t0)
            computed = sum(len(o.prompt_token_ids) - o.num_cached_tokens for o in outs)
        return best, computed

    forked = run(lambda: llm.generate([prompt], SamplingParams(max_tokens=args.max_tokens, temperature=0,
                                                               ignore_eos=True, n=args.n)))
    separate = run(lambda: llm.generate([prompt] * args.n, greedy))
    print(f"n={args.n}, prompt {args.prompt_tokens} tokens, {args.max_tokens} new each:")
    print(f"  fork:     {forked[0]:.3f} s, {forked[1]} prompt tokens computed")
    print(f"  separate: {separate[0]:.3f} s, {separate[1]} prompt tokens computed")
    print(f"  fork / separate wall time: {forked[0] / separate[0]:.2f}")

    short = prompt[:32]
    plain = SamplingParams(max_tokens=args.decode_tokens, temperature=0, ignore_eos=True)
    penalized = SamplingParams(max_tokens=args.decode_tokens, temperature=0, ignore_eos=True,
                               presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2,
                               logit_bias={100: 5.0, 101: -5.0})
    times = {}
    for name, params in (("plain", plain), ("penalized", penalized)):
        times[name] = run(lambda: llm.generate([short], params))[0]
    for name, t in times.items():
        print(f"  decode {name}: {args.decode_tokens / t:.1f} tok/s")
    print(f"  penalized / plain tok/s: {times['plain'] / times['penalized']:.3f}")
    llm.close()


if __name__ == "__main__":
    main()
