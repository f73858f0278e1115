"""What guided decoding costs (BENCHMARKS.md, "Guided decoding").

    python -m engine.guided_bench engines   # xgrammar vs llguidance: compile and per-token mask cost
    python -m engine.guided_bench decode    # engine.LLM decode, a json_schema request vs the same unguided

``engines`` drives each library's matcher through the tokens of a valid
output of the schema, with the default model's tokenizer: per step, the
mask fill of every row and the in-place apply to [rows, vocab] float32
logits (llguidance is not a dependency: install it to compare). ``decode``
runs the default model through `engine.LLM`, 1 and 16 streams, guided and
not, the same number of tokens each (a schema whose output is long).
Figures are the median of the repetitions; the machine's load is printed.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "tags": {"type": "array", "items": {"type": "string"}}}}
OUTPUT = {"name": "Alice Smith", "age": 31, "tags": ["engineer", "climber", "reader", "cook", "painter"]}
# decode: an array long enough that the grammar never ends before max_tokens
LONG = {"type": "array", "minItems": 200, "items": {"type": "integer", "minimum": 0, "maximum": 99}}


def _median(xs):
    return statistics.median(xs)


def _load() -> str:
    return "load average " + " ".join(f"{x:.1f}" for x in os.getloadavg())


def engines(reps: int) -> None:
    from transformers import AutoTokenizer

    from engine.weights import resolve_model

    folder = resolve_model(None)
    hf = AutoTokenizer.from_pretrained(str(folder))
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    ids = hf.encode(json.dumps(OUTPUT), add_special_tokens=False)
    print(f"{_load()}; {len(ids)} tokens through the matcher, vocab {vocab}")
    import xgrammar as xgr

    from engine.guided import apply_bitmask

    t = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
    setup = time.perf_counter() - t
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    compile_s = []
    for _ in range(reps):
        t = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
        compile_s.append(time.perf_counter() - t)
    print(f"xgrammar    tokenizer setup {setup * 1e3:6.0f} ms, compile {_median(compile_s) * 1e3:6.1f} ms")

    def xgr_rows(n):
        ms = [xgr.GrammarMatcher(compiled) for _ in range(n)]
        return ms, xgr.allocate_token_bitmask(n, vocab), lambda m, bm, i: m.fill_next_token_bitmask(bm, i), \
            lambda m, tok: m.accept_token(tok), lambda lg, bm: xgr.apply_token_bitmask_inplace(lg, bm)

    _steps("xgrammar", xgr_rows, ids, vocab, reps)

    def xgr_torch_rows(n):  # what kvrelay runs: xgrammar's masks, applied by engine.guided.apply_bitmask
        ms, bm, fill, accept, _ = xgr_rows(n)
        return ms, bm, fill, accept, lambda lg, bm: apply_bitmask(lg, bm, range(n))

    _steps("xgr+torch", xgr_torch_rows, ids, vocab, reps)
    try:
        import llguidance
        import llguidance.hf
        import llguidance.torch as llt
    except ImportError:
        print("llguidance is not installed: pip install llguidance to compare")
        return
    t = time.perf_counter()
    ltok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab)
    setup = time.perf_counter() - t
    compile_s = []
    for _ in range(reps):
        t = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
        llguidance.LLMatcher(ltok, grammar)
        compile_s.append(time.perf_counter() - t)
    print(f"llguidance  tokenizer setup {setup * 1e3:6.0f} ms, compile {_median(compile_s) * 1e3:6.1f} ms "
          "(lazy: the work happens per token)")

    def llg_rows(n):
        ms = [llguidance.LLMatcher(ltok, grammar) for _ in range(n)]
        return ms, llt.allocate_token_bitmask(n, ltok.vocab_size), lambda m, bm, i: llt.fill_next_token_bitmask(
            m, bm, i), lambda m, tok: m.consume_token(tok), lambda lg, bm: llt.apply_token_bitmask_inplace(lg, bm)

    _steps("llguidance", llg_rows, ids, vocab, reps)


def _steps(name, rows, ids, vocab, reps) -> None:
    for n in (1, 16):
        fills, applies = [], []
        for rep in range(reps + 1):  # the first pass warms up (lazy kernels, caches)
            matchers, bitmask, fill, accept, apply = rows(n)
            logits = torch.randn(n, vocab)
            for tok in ids:
                t0 = time.perf_counter()
                for i, m in enumerate(matchers):
                    fill(m, bitmask, i)
                t1 = time.perf_counter()
                apply(logits, bitmask)
                t2 = time.perf_counter()
                for m in matchers:
                    assert accept(m, tok)
                if rep:
                    fills.append(t1 - t0)
                    applies.append(t2 - t1)
        print(f"{name:11s} {n:2d} rows: fill {_median(fills) * 1e6:7.0f} us/step, apply {_median(applies) * 1e6:6.0f}"
              f" us/step")


def decode(reps: int, max_tokens: int) -> None:
    from engine.guided import GuidedSpec
    from engine.llm import LLM
    from engine.sampling import SamplingParams

    llm = LLM(num_kv_blocks=1024, max_num_seqs=16)
    prompt = "Write many small numbers as a JSON array."
    spec = GuidedSpec.json_schema(LONG)
    print(f"{_load()}; dtype {llm.core.dtype_name}, torch threads {torch.get_num_threads()}, "
          f"{max_tokens} tokens per stream")
    llm.generate(prompt, SamplingParams(max_tokens=4, temperature=0, guided=spec))  # compiles, warms up
    spent = _time_guided_path()
    for n in (1, 16):
        times: dict[str, list[float]] = {"unguided": [], "json_schema": []}
        in_mask: list[float] = []  # the guided run's share of time in the mask path (fill, apply, accept)
        for rep in range(reps):  # interleaved, so a change in the machine's load hits both alike
            order = (("unguided", None), ("json_schema", spec))
            for label, guided in order if rep % 2 == 0 else order[::-1]:
                params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, guided=guided)
                before = spent[0]
                t = time.perf_counter()
                outs = llm.generate([prompt] * n, params)
                times[label].append(time.perf_counter() - t)
                if guided is not None:
                    in_mask.append((spent[0] - before) / times[label][-1])
                assert all(len(o.token_ids) == max_tokens for o in outs), [len(o.token_ids) for o in outs]
        rates = {label: n * max_tokens / _median(ts) for label, ts in times.items()}
        cost = 1 - rates["json_schema"] / rates["unguided"]
        print(f"{n:2d} streams: unguided {rates['unguided']:7.1f} tok/s, json_schema {rates['json_schema']:7.1f} "
              f"tok/s: guided costs {cost * 100:5.1f}% of throughput "
              f"({(1 / rates['json_schema'] - 1 / rates['unguided']) * n * 1e3:.2f} ms per step); "
              f"time in the mask path: {_median(in_mask) * 100:.1f}% of the guided run "
              f"({_median(in_mask) * _median(times['json_schema']) / max_tokens * 1e3:.2f} ms per step)")


def _time_guided_path() -> list[float]:
    """Accumulate the seconds spent masking logits and advancing matchers (a one-item list)."""
    import engine.runner
    from engine.guided import GrammarState

    spent = [0.0]

    def timed(fn):
        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - t
        return wrapper

    engine.runner.apply_masks = timed(engine.runner.apply_masks)
    GrammarState.accept = timed(GrammarState.accept)
    return spent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["engines", "decode"])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args()
    if args.what == "engines":
        engines(args.reps)
    else:
        decode(args.reps, args.max_tokens)


if __name__ == "__main__":
    main()
