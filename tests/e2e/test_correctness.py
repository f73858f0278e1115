"""Greedy output streamed through the cluster equals engine.LLM's, token for
token: disaggregated over gRPC and over NCCL-on-gloo (2 prefill x 2 decode),
and colocated; 16 concurrent requests each; every pool free afterwards. A
request with logprobs gets them for every token, the first included (which
a prefill replica samples), equal to engine.LLM's."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from engine.llm import LLM
from engine.sampling import SamplingParams
from tests.e2e.conftest import colocated_spec, disagg_spec, running_cluster

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain what a KV cache is in one sentence.",
    "List three prime numbers.",
    "Who wrote Pride and Prejudice?",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 12?",
    "Name a famous painting by Leonardo da Vinci.",
]
MAX_TOKENS = 24
LOGPROB_PROMPTS = [0, 4, 9]  # indices into the 16 requests
NUM_TOP = 3


def _messages(i: int) -> list[dict]:
    # 16 requests: the 8 prompts as chats, plus 8 with a long shared system prompt
    p = PROMPTS[i % len(PROMPTS)]
    if i < len(PROMPTS):
        return [{"role": "user", "content": p}]
    return [{"role": "system", "content": "You are a careful assistant. " * 12}, {"role": "user", "content": p}]


@pytest.fixture(scope="module")
def reference(default_model_dir):
    llm = LLM(str(default_model_dir), dtype="float32", num_kv_blocks=256)
    tok = llm.tokenizer
    prompts = [tok.encode(tok.apply_chat_template(_messages(i)), add_special_tokens=False) for i in range(16)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    assert llm.core.pool.is_fully_free()
    return [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def reference_logprobs(default_model_dir):
    llm = LLM(str(default_model_dir), dtype="float32", num_kv_blocks=256)
    tok = llm.tokenizer
    prompts = [tok.encode(tok.apply_chat_template(_messages(i)), add_special_tokens=False) for i in LOGPROB_PROMPTS]
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, logprobs=NUM_TOP))
    return [(o.token_ids, o.logprobs) for o in outs]


SPECS = [
    pytest.param(disagg_spec(2, 2, "grpc"), id="disagg-grpc"),
    pytest.param(disagg_spec(2, 2, "nccl"), id="disagg-nccl-gloo"),
    pytest.param(colocated_spec(2), id="colocated"),
]


@pytest.fixture(scope="module", params=SPECS)
def served(request, ray_instance):
    with running_cluster(request.param) as rc:
        yield rc


def _run_16(rc) -> list[list[int]]:
    def one(i):
        return rc.client.chat(_messages(i), max_tokens=MAX_TOKENS, temperature=0).token_ids
    with ThreadPoolExecutor(16) as pool:
        return list(pool.map(one, range(16)))


def test_cluster_greedy_equals_engine(served, reference):
    got = _run_16(served)
    for i, (g, want) in enumerate(zip(got, reference)):
        assert g == want, f"request {i} differs from engine.LLM"
    # every replica served something (the router spread the load)
    status = served.client.status()
    assert all(r.is_alive for r in status.replicas)
    assert served.wait_pools_free() == {rid: True for rid in served.cluster.actors}


def test_logprobs_for_every_token_equal_engine(served, reference_logprobs):
    for i, (want_ids, want) in zip(LOGPROB_PROMPTS, reference_logprobs):
        got = served.client.chat(_messages(i), max_tokens=8, temperature=0, logprobs=NUM_TOP)
        assert got.token_ids == want_ids
        assert [lp.token_id for lp in got.logprobs] == want_ids, f"request {i}: a token without logprobs"
        for k, (lp, ref) in enumerate(zip(got.logprobs, want)):
            assert lp.logprob == pytest.approx(ref["token_logprob"], abs=1e-3), f"request {i} token {k}"
            assert [t for t, _ in lp.top] == [t for t, _ in ref["top"]], f"request {i} token {k}"
            assert [p for _, p in lp.top] == pytest.approx([p for _, p in ref["top"]], abs=1e-3)
    assert served.wait_pools_free() == {rid: True for rid in served.cluster.actors}
