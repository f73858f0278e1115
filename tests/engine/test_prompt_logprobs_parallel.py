"""The prompt's logprobs on a replica of several ranks: tensor-parallel (every rank's slice of the LM
head on the scored positions, the logits gathered to rank 0), pipeline-parallel (the last stage scores
them and returns each position's logprob, rank and top k, batches in flight behind each other) and
both. Each position is scored once and equals transformers' on the same weights, whole or chunked,
past a preemption; the generated tokens are those of one rank; every rank ends with its pool free."""
from __future__ import annotations

import pytest

from engine.llm import LLM
from engine.parallel.runner import TPRunner
from engine.sampling import SamplingParams
from tests.engine.factories import random_prompts, save_tiny_model
from tests.engine.test_prompt_logprobs import VOCAB, check, params

# name: (engine overrides, top alternatives, sampling extras). The tiny model: 4 layers, 4 heads, 2 KV heads.
# Greedy without logprobs, the last pipeline stage returns each sampled row's token (its argmax) before
# the scores; with the generated tokens' logprobs asked for too, it returns their logits rows.
CASES = {
    "tp2": ({"tensor_parallel_size": 2}, 3, {}),
    "tp2-gloo-no-top": ({"tensor_parallel_size": 2, "tp_backend": "gloo"}, 0, {}),
    # chunks of 8: a prompt's next chunk enters the pipeline before the last one's scores are back
    "pp2-chunked": ({"pipeline_parallel_size": 2, "max_num_batched_tokens": 8}, 2, {}),
    "pp2-chunked-logits-rows": ({"pipeline_parallel_size": 2, "max_num_batched_tokens": 8}, 2, {"logprobs": 3}),
    "pp3-split-1-2-1-gloo": ({"pipeline_parallel_size": 3, "pipeline_layer_split": [1, 2, 1],
                              "tp_backend": "gloo", "max_num_batched_tokens": 16}, 5, {}),
    "pp2-gloo-logits-rows": ({"pipeline_parallel_size": 2, "tp_backend": "gloo"}, 1, {"logprobs": 1}),
    "pp2xtp2": ({"pipeline_parallel_size": 2, "tensor_parallel_size": 2}, 1, {}),
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-4-layers")
    save_tiny_model(path, num_hidden_layers=4)
    return path


@pytest.fixture(scope="module")
def hf(folder):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()


def make_llm(folder, **kw) -> LLM:
    return LLM(str(folder), **{"dtype": "float32", "num_kv_blocks": 256, "block_size": 4, **kw})


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_parallel_replica_scores_the_prompt_as_one_rank(folder, hf, name):
    engine_kw, k, extras = CASES[name]
    prompts = random_prompts(4, VOCAB, [5, 40, 23, 2], seed=11)
    with make_llm(folder) as one:
        want = one.generate(prompts, params(k, max_tokens=6, ignore_eos=True, **extras))
    with make_llm(folder, **engine_kw) as llm:
        assert isinstance(llm.core.runner, TPRunner)  # (PPRunner is one too)
        outs = llm.generate(prompts, params(k, max_tokens=6, ignore_eos=True, **extras))
        # a request that asks for nothing beside them still runs the argmax path of the last stage
        plain = llm.generate(prompts[:2], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
        assert llm.core.pool.is_fully_free()
    for out, ref in zip(outs, want):
        check(out, hf, k)
        assert out.token_ids == ref.token_ids
        if extras:  # the generated tokens' own logprobs, from the logits rows returned beside the scores
            assert [[t for t, _ in lp["top"]] for lp in out.logprobs] == [[t for t, _ in lp["top"]]
                                                                          for lp in ref.logprobs]
    assert [o.token_ids for o in plain] == [o.token_ids for o in want[:2]]
    assert all(o.prompt_logprobs is None for o in plain)


def test_a_pipeline_replica_keeps_one_logprob_per_position_past_preemptions(folder, hf):
    """A pool too small for every request at once preempts some, with batches in the pipeline:
    their prompts are computed again, and scored positions are neither lost nor doubled."""
    with make_llm(folder, pipeline_parallel_size=2, num_kv_blocks=24, max_num_seqs=4,
                  max_num_batched_tokens=16) as llm:
        prompts = random_prompts(4, VOCAB, [20, 20, 20, 20], seed=3)
        outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                    prompt_logprobs=1))
        assert sum(o.metrics["num_preemptions"] for o in outs) > 0
        assert llm.core.pool.is_fully_free()
    for out in outs:
        check(out, hf, 1)
