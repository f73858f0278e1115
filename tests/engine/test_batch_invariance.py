"""A request's greedy output does not depend on what else the engine is doing:
batching, chunked prefill, prefix-cache hits and preemption change only the
schedule, never the tokens: float32 (torch's ops), and bfloat16 on each
native CPU kernel ISA path (every matmul row, norm and attention head is
computed the same way whatever else is in the batch)."""
from __future__ import annotations

import pytest
import torch

from engine.llm import LLM
from engine.sampling import SamplingParams
from tests.conftest import require_isa
from tests.engine.factories import random_prompts, save_tiny_model

LENGTHS = [1, 120, 7, 64, 33, 2, 97, 16, 15, 17, 50, 81, 5, 110, 31, 48]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    save_tiny_model(folder, "llama", max_position_embeddings=256)
    return folder


@pytest.fixture(scope="module", params=["float32", "bfloat16-avx512bf16", "bfloat16-avx512", "bfloat16-avx2"])
def numerics(request) -> dict:
    """LLM arguments for one way of computing: fp32 on torch's ops, or bf16 on a kernel ISA path."""
    dtype, _, isa = request.param.partition("-")
    return {"dtype": dtype, "kernel_isa": require_isa(isa) if isa else "auto"}


def make_llm(model_dir, numerics, **kw) -> LLM:
    llm = LLM(str(model_dir), **dict({"num_kv_blocks": 256}, **numerics, **kw))
    assert getattr(llm.core.model.ops, "isa", "auto") == numerics["kernel_isa"]
    return llm


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(len(LENGTHS), 96, LENGTHS, seed=11)


@pytest.fixture(scope="module")
def shared_prefix_prompts():
    """Two families of prompts, each sharing a long prefix, with distinct tails."""
    heads = random_prompts(2, 96, [70, 37], seed=12)
    tails = random_prompts(10, 96, [1, 5, 16, 3, 20, 9, 2, 13, 30, 7], seed=13)
    return [heads[i % 2] + t for i, t in enumerate(tails)]


def alone(model_dir, numerics, prompts) -> list[list[int]]:
    """Each prompt run by itself in a fresh-as-possible engine (no prefix cache)."""
    llm = make_llm(model_dir, numerics, enable_prefix_caching=False)
    out = [llm.generate(p, GREEDY)[0].token_ids for p in prompts]
    assert llm.core.pool.is_fully_free()
    return out


@pytest.fixture(scope="module")
def reference(model_dir, numerics, prompts):
    return alone(model_dir, numerics, prompts)


def test_batch_of_mixed_lengths_equals_alone(model_dir, numerics, prompts, reference):
    llm = make_llm(model_dir, numerics)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert llm.core.num_steps == GREEDY.max_tokens  # one prefill step, then all decode together
    assert llm.core.pool.is_fully_free()


@pytest.mark.parametrize("budget", [16, 32])
def test_chunked_prefill_equals_alone(model_dir, numerics, prompts, reference, budget):
    llm = make_llm(model_dir, numerics, max_num_batched_tokens=budget)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert llm.core.num_steps >= sum(LENGTHS) // budget  # prompts really were split across steps
    assert llm.core.pool.is_fully_free()


def test_prefix_cache_hits_equal_alone(model_dir, numerics, shared_prefix_prompts):
    prompts = shared_prefix_prompts
    ref = alone(model_dir, numerics, prompts)
    llm = make_llm(model_dir, numerics, max_num_batched_tokens=48)
    first = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in first] == ref
    second = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in second] == ref
    for p, o in zip(prompts, second):
        assert o.num_cached_tokens >= 16 * ((len(p) - 1) // 16) - 16 > 0, (len(p), o.num_cached_tokens)
    one = llm.generate(prompts[3], GREEDY)[0]  # a hit while decoding alone
    assert one.num_cached_tokens > 0 and one.token_ids == ref[3]
    assert llm.core.pool.is_fully_free()
    llm.core.pool.reset_prefix_cache()
    assert llm.core.pool.num_cached_blocks == 0


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_equals_alone(model_dir, numerics, prompts, reference, prefix_caching):
    # the longest request needs ceil((120 + 24) / 16) = 9 blocks; 16 requests share 14
    llm = make_llm(model_dir, numerics, num_kv_blocks=14, max_num_batched_tokens=64,
                   enable_prefix_caching=prefix_caching)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert sum(o.metrics["num_preemptions"] for o in outs) > 0
    assert all(o.finish_reason == "length" for o in outs)
    assert llm.core.pool.is_fully_free()


@pytest.fixture
def one_thread():
    """Intra-op threads spin-wait; on a shared, oversubscribed CPU one thread
    is several times faster than two for a model this size."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_default_model_alone_equals_batched(default_model_dir, numerics, one_thread):
    llm = make_llm(default_model_dir, numerics, num_kv_blocks=64, enable_prefix_caching=False)
    texts = ["The capital of France is", "def add(a, b):", "Water boils at",
             "Once upon a time, in a small village by the sea, there lived", "1 2 3 4", "Hello"]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    solo = [llm.generate(t, params)[0].token_ids for t in texts]
    batched = [o.token_ids for o in llm.generate(texts, params)]
    assert batched == solo
    assert llm.core.pool.is_fully_free()
