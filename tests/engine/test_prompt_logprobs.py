"""The prompt's logprobs (`SamplingParams.prompt_logprobs`): what transformers gives for the same
weights, whole or chunked, past the prefix cache and a preemption, once per request."""
from __future__ import annotations

import pytest
import torch

from engine.sampling import SamplingError, SamplingParams
from tests.engine.factories import random_prompts, save_tiny_model

VOCAB = 96


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    save_tiny_model(path)
    return path


def make_llm(folder, **kw):
    from engine.llm import LLM

    return LLM(str(folder), **{"dtype": "float32", "num_kv_blocks": 256, "block_size": 4, **kw})


@pytest.fixture(scope="module")
def hf(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()


def reference(hf, prompt: list[int]) -> torch.Tensor:
    """transformers' log-softmax at every prompt position: row p scores token p + 1."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0, :-1].float()
    return logits.log_softmax(-1)


def check(out, hf, k: int) -> None:
    prompt = out.prompt_token_ids
    ref = reference(hf, prompt)
    lps = out.prompt_logprobs
    assert lps is not None and len(lps) == len(prompt) and lps[0] is None
    got = torch.tensor([lp["token_logprob"] for lp in lps[1:]])
    want = ref.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    for p, lp in enumerate(lps[1:]):
        assert lp["rank"] == int((ref[p] > want[p]).sum()) + 1
        assert len(lp["top"]) == k
        if k:
            assert [t for t, _ in lp["top"]] == ref[p].topk(k).indices.tolist()


def params(k: int = 2, **kw) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 3, "temperature": 0.0, "prompt_logprobs": k, **kw})


@pytest.mark.parametrize("k", [0, 3])
def test_prompt_logprobs_match_transformers(folder, hf, k):
    llm = make_llm(folder)
    prompts = random_prompts(3, VOCAB, [5, 17, 30])
    for out in llm.generate(prompts, params(k)):
        check(out, hf, k)
    assert llm.core.pool.is_fully_free()


def test_chunked_prefill_gives_the_same_prompt_logprobs(folder, hf):
    """A 40-token prompt in chunks of 8 tokens (beside another request) scores each position once."""
    llm = make_llm(folder, max_num_batched_tokens=8)
    prompts = random_prompts(2, VOCAB, [40, 9], seed=1)
    outs = llm.generate(prompts, params())
    for out in outs:
        check(out, hf, 2)
    assert llm.core.pool.is_fully_free()


def test_a_cached_prefix_does_not_skip_positions(folder, hf):
    """The second request's prompt is all in the prefix cache: it still gets every position's logprob,
    and a request that does not ask for them still reuses the cache."""
    llm = make_llm(folder)
    prompt = random_prompts(1, VOCAB, [24], seed=2)[0]
    llm.generate([prompt], SamplingParams(max_tokens=1))
    out = llm.generate([prompt], params())[0]
    check(out, hf, 2)
    assert out.num_cached_tokens == 0
    again = llm.generate([prompt], SamplingParams(max_tokens=1))[0]
    assert again.num_cached_tokens > 0 and again.prompt_logprobs is None
    assert llm.core.pool.is_fully_free()


def test_preempted_requests_keep_one_logprob_per_position(folder, hf):
    """A pool too small for every request at once preempts some mid-generation: their prompts are
    computed again, and their prompt logprobs are neither lost nor doubled."""
    llm = make_llm(folder, num_kv_blocks=24, max_num_seqs=4)
    prompts = random_prompts(4, VOCAB, [20, 20, 20, 20], seed=3)
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                prompt_logprobs=1))
    assert sum(o.metrics["num_preemptions"] for o in outs) > 0
    for out in outs:
        check(out, hf, 1)
    assert llm.core.pool.is_fully_free()


def test_every_choice_gets_choice_zeros_prompt_logprobs(folder, hf):
    llm = make_llm(folder)
    prompt = random_prompts(1, VOCAB, [13], seed=4)[0]
    outs = llm.generate([prompt], params(1, n=3, temperature=1.0, seed=5))
    assert len(outs) == 3
    for out in outs:
        check(out, hf, 1)
    assert outs[1].prompt_logprobs == outs[0].prompt_logprobs
    assert llm.core.pool.is_fully_free()


def test_the_generated_tokens_are_the_same_with_prompt_logprobs(folder):
    llm = make_llm(folder)
    prompts = random_prompts(3, VOCAB, [6, 11, 19], seed=6)
    plain = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0))
    scored = llm.generate(prompts, params(4, max_tokens=8))
    assert [o.token_ids for o in scored] == [o.token_ids for o in plain]
    assert all(o.prompt_logprobs is None for o in plain)
    assert llm.core.pool.is_fully_free()


@pytest.mark.parametrize("bad", [-1, 21, 2.5, True])
def test_a_bad_prompt_logprobs_is_refused_by_name(bad):
    with pytest.raises(SamplingError, match="prompt_logprobs: must be an integer between 0 and 20"):
        SamplingParams(prompt_logprobs=bad)


def test_prompt_logprobs_bench_times_each_setting(folder, tmp_path, monkeypatch):
    """python -m engine.prompt_logprobs_bench on the tiny model: every setting at every length, with its
    ratio to the run without them in each round, in its own section of BENCHMARKS.md."""
    import re

    from engine import benchmarks_md, prompt_logprobs_bench

    md = tmp_path / "BENCHMARKS.md"
    write = benchmarks_md.write_section
    monkeypatch.setattr(benchmarks_md, "write_section", lambda text: write(text, md))
    assert prompt_logprobs_bench.main(["--model", str(folder), "--prompt-lens", "9,40", "--top", "0,3",
                                       "--rounds", "2", "--layouts", "1x1,2x1", "--write"]) == 0
    text = md.read_text()
    assert text.count(prompt_logprobs_bench.SECTION) == 1
    for layout in ("1 x 1", "2 x 1"):  # one rank, and two tensor-parallel ranks
        for length in (9, 40):
            for name in ("without", "prompt_logprobs=0", "prompt_logprobs=3"):
                row = re.search(rf"^\| {layout} \| {length} \| {re.escape(name)} \| ([\d.]+) \| ([\d.]+), "
                                rf"([\d.]+) \| \*\*([\d.]+)x\*\* \|$", text, re.M)
                assert row and all(float(g) > 0 for g in row.groups()), (layout, length, name, text)
                if name == "without":
                    assert row.groups()[1:] == ("1.00", "1.00", "1.00")
    with pytest.raises(SystemExit, match="--layouts 2,1x0: each must be TPxPP"):
        prompt_logprobs_bench.main(["--model", str(folder), "--layouts", "2,1x0"])
    with pytest.raises(SystemExit, match="--top 0,21: each must be 0 to 20"):
        prompt_logprobs_bench.main(["--model", str(folder), "--top", "0,21"])
    with pytest.raises(SystemExit, match="--prompt-lens 1: each prompt needs at least 2 tokens"):
        prompt_logprobs_bench.main(["--model", str(folder), "--prompt-lens", "1"])
