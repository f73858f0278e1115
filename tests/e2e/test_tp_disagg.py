"""Disaggregated serving with prefill and decode at different tensor-parallel sizes, over the
real local Ray: the KV cache is resharded on the way (each decode rank gets exactly its KV
heads, from the prefill ranks that hold them; `kvtransfer.reshard`). 16 concurrent requests
are token for token what engine.LLM at TP=1 gives, over both transports, and every pool is
free afterwards; nothing (placement group, rank process, segment) is left when it stops."""
from __future__ import annotations

import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from cluster.bench.chaos import HEALTH
from engine.llm import LLM
from engine.sampling import SamplingParams
from tests.e2e.conftest import SLICE, running_cluster
from tests.e2e.tp_cluster import check_scored, placement_groups, rank_pids, scored_reference, segments, wait_gone
from tests.engine.factories import random_prompts, save_tiny_model_with_tokenizer

MAX_TOKENS = 12
NUM_REQUESTS = 16
# 6 heads and 6 KV heads: TP 1, 2 and 3 all split it (vocab 49152 too)
HEADS = {"num_attention_heads": 6, "num_key_value_heads": 6, "hidden_size": 48, "intermediate_size": 96}


@pytest.fixture(scope="module")
def model(tmp_path_factory, default_model_dir):
    folder = tmp_path_factory.mktemp("tiny-tp-disagg")
    save_tiny_model_with_tokenizer(folder, default_model_dir, **HEADS)
    return folder


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(NUM_REQUESTS, 2000, [5, 19, 33, 40])


@pytest.fixture(scope="module")
def reference(model, prompts):
    llm = LLM(str(model), dtype="float32", num_kv_blocks=128)
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    return [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def scored(model, prompts):
    return scored_reference(model, prompts)


def _spec(model, prefill_tp: int, decode_tp: int, backend: str) -> dict:
    stage = {"replicas": 1, "resources": SLICE, "num_kv_blocks": 64, "tp_timeout_s": 10.0}
    return {"model": str(model), "mode": "disaggregated", "health": HEALTH,
            "prefill": dict(stage, tensor_parallel_size=prefill_tp, max_num_batched_tokens=256),
            "decode": dict(stage, tensor_parallel_size=decode_tp),
            "transfer": {"backend": backend, "options": {"lease_s": 20, "deadline_s": 30}}}


# each backend: a split (one rank's heads to several), a merge, and (nccl) equal layouts; the plans
# themselves, every pair, are tests/kvtransfer's
@pytest.mark.parametrize("prefill_tp, decode_tp, backend", [
    (1, 2, "grpc"), (2, 1, "grpc"), (3, 1, "grpc"),
    (2, 2, "nccl"), (3, 1, "nccl"), (1, 3, "nccl")])
def test_prefill_and_decode_at_different_tp_equal_engine_tp1(ray_instance, model, prompts, reference, scored,
                                                             prefill_tp, decode_tp, backend):
    groups_before = len(placement_groups())
    with running_cluster(_spec(model, prefill_tp, decode_tp, backend)) as rc:
        pids = {rid: rank_pids(rc, rid) for rid in rc.cluster.actors}
        assert [len(pids["prefill-0"]), len(pids["decode-0"])] == [prefill_tp, decode_tp]

        def generate(p):
            return list(rc.client.generate(token_ids=p, max_tokens=MAX_TOKENS, temperature=0,
                                           ignore_eos=True).token_ids)
        with ThreadPoolExecutor(NUM_REQUESTS) as pool:
            got = list(pool.map(generate, prompts))
        for i, (g, want) in enumerate(zip(got, reference)):
            assert g == want, f"request {i} at prefill TP={prefill_tp} -> decode TP={decode_tp} ({backend})"
        check_scored(rc.client, prompts, scored)  # the prefill ranks' LM-head slices, gathered to rank 0
        assert rc.wait_pools_free() == {rid: True for rid in rc.cluster.actors}
        status = {r.replica_id: r for r in rc.client.status().replicas}
        assert (status["prefill-0"].tensor_parallel_size, status["decode-0"].tensor_parallel_size) == \
            (prefill_tp, decode_tp)
    every = [p for ps in pids.values() for p in ps]
    assert len(placement_groups()) == groups_before
    assert wait_gone(every) == []
    assert segments(every) == set()


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory, default_model_dir):
    """A tiny random Qwen3-MoE (4 experts, top-2) with the default model's tokenizer."""
    folder = tmp_path_factory.mktemp("tiny-moe-disagg")
    save_tiny_model_with_tokenizer(folder, default_model_dir, kind="qwen3_moe")
    return folder


EP = {"enable_expert_parallel": True}


@pytest.mark.parametrize("prefill, decode_tp, decode", [
    pytest.param(EP, 1, {}, id="ep2-allreduce-to-tp1"),
    pytest.param(dict(EP, moe_dispatch="alltoall"), 2, dict(EP, moe_dispatch="allreduce"),
                 id="ep2-alltoall-to-ep2-allreduce")])
def test_moe_prefill_with_expert_parallelism_hands_off_to_another_layout(ray_instance, moe_model, prompts,
                                                                         prefill, decode_tp, decode):
    """The KV is attention's only: the reshard plan applies unchanged between an expert-parallel
    prefill (TP=2, EP) and a decode of another layout, and each stage runs the expert dispatch
    its own spec names (prefill alltoall, decode allreduce)."""
    llm = LLM(str(moe_model), dtype="float32", num_kv_blocks=128)
    want = [o.token_ids for o in llm.generate(prompts[:8], SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                                                            ignore_eos=True))]
    spec = _spec(moe_model, 2, decode_tp, "grpc")
    spec["prefill"].update(prefill)
    spec["decode"].update(decode)
    with running_cluster(spec) as rc:
        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda p: list(rc.client.generate(token_ids=p, max_tokens=MAX_TOKENS, temperature=0,
                                                                  ignore_eos=True).token_ids), prompts[:8]))
        assert got == want
        assert rc.wait_pools_free() == {rid: True for rid in rc.cluster.actors}
        # per-expert load reaches the metrics, for each replica (prefill routes the prompts, decode the rest)
        time.sleep(0.5)  # a load poll after the last step
        body = urllib.request.urlopen(f"http://127.0.0.1:{rc.http_port}/metrics", timeout=10).read().decode()
        routed = {rid: sum(float(line.rsplit(" ", 1)[1]) for line in body.splitlines()
                           if line.startswith("kvrelay_replica_expert_tokens_total{") and f'replica="{rid}"' in line)
                  for rid in ("prefill-0", "decode-0")}
        prompt_tokens = sum(len(p) for p in prompts[:8])
        assert routed["prefill-0"] >= prompt_tokens * 2  # top-2 over every sparse layer: at least one layer's
        assert routed["decode-0"] > 0, routed
