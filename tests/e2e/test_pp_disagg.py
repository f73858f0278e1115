"""Disaggregated serving with a pipeline-parallel prefill, over the real local Ray: each
prefill pipeline rank holds only its layers' KV, and the hand-off moves every (layer, KV-head
range) from the rank that holds it to each decode rank that holds it, paired by global layer
id (`kvtransfer.reshard`). 16 concurrent requests are token for token what engine.LLM at PP=1,
TP=1 gives, so are the prompt's logprobs (the last stage scores them), every pool is free
afterwards, and nothing (placement group, rank process,
segment) is left when it stops. A pipeline rank killed mid-prefill ends its requests within
the bound."""
from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from cluster.bench.chaos import HEALTH
from engine.llm import LLM
from engine.sampling import SamplingParams
from tests.e2e.conftest import SLICE, running_cluster
from tests.e2e.tp_cluster import (check_scored, placement_groups, rank_pids, scored_reference, segments,
                                  wait_gone)
from tests.engine.factories import random_prompts, save_tiny_model_with_tokenizer

MAX_TOKENS = 12
NUM_REQUESTS = 16
# 4 layers (splits [2, 2] and [1, 3]); 6 heads and 6 KV heads: TP 1, 2 and 3 all split it
SHAPE = {"num_hidden_layers": 4, "num_attention_heads": 6, "num_key_value_heads": 6, "hidden_size": 48,
         "intermediate_size": 96}


@pytest.fixture(scope="module")
def model(tmp_path_factory, default_model_dir):
    folder = tmp_path_factory.mktemp("tiny-pp-disagg")
    save_tiny_model_with_tokenizer(folder, default_model_dir, **SHAPE)
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


def _spec(model, prefill: dict, decode_tp: int, backend: str) -> dict:
    stage = {"replicas": 1, "resources": SLICE, "num_kv_blocks": 64, "tp_timeout_s": 10.0}
    return {"model": str(model), "mode": "disaggregated", "health": HEALTH,
            "prefill": dict(stage, **{"max_num_batched_tokens": 256, **prefill}),
            "decode": dict(stage, tensor_parallel_size=decode_tp),
            "transfer": {"backend": backend, "options": {"lease_s": 20, "deadline_s": 30}}}


@pytest.mark.parametrize("prefill, decode_tp, backend", [
    ({"pipeline_parallel_size": 2}, 1, "grpc"),
    ({"pipeline_parallel_size": 2, "pipeline_layer_split": [1, 3]}, 2, "grpc"),
    ({"pipeline_parallel_size": 2, "tensor_parallel_size": 2}, 2, "grpc"),
    ({"pipeline_parallel_size": 2}, 1, "nccl"),
    ({"pipeline_parallel_size": 2, "tp_backend": "gloo"}, 1, "grpc"),  # the stages' hand-offs over gloo
], ids=["pp2-tp1-grpc", "pp2split13-tp2-grpc", "pp2xtp2-tp2-grpc", "pp2-tp1-nccl", "pp2gloo-tp1-grpc"])
def test_a_pipeline_parallel_prefill_hands_off_token_exact(ray_instance, model, prompts, reference, scored,
                                                           prefill, decode_tp, backend):
    groups_before = len(placement_groups())
    ranks = prefill["pipeline_parallel_size"] * prefill.get("tensor_parallel_size", 1)
    with running_cluster(_spec(model, prefill, decode_tp, backend)) as rc:
        pids = {rid: rank_pids(rc, rid) for rid in rc.cluster.actors}
        assert [len(pids["prefill-0"]), len(pids["decode-0"])] == [ranks, decode_tp]

        def generate(p):
            return list(rc.client.generate(token_ids=p, max_tokens=MAX_TOKENS, temperature=0,
                                           ignore_eos=True).token_ids)
        with ThreadPoolExecutor(NUM_REQUESTS) as pool:
            got = list(pool.map(generate, prompts))
        for i, (g, want) in enumerate(zip(got, reference)):
            assert g == want, f"request {i} at prefill {prefill} -> decode TP={decode_tp} ({backend})"
        check_scored(rc.client, prompts, scored)  # the last stage scores the prompt
        assert rc.wait_pools_free() == {rid: True for rid in rc.cluster.actors}
        status = {r.replica_id: r for r in rc.client.status().replicas}
        assert (status["prefill-0"].tensor_parallel_size, status["prefill-0"].pipeline_parallel_size) == \
            (prefill.get("tensor_parallel_size", 1), prefill["pipeline_parallel_size"])
        assert (status["decode-0"].tensor_parallel_size, status["decode-0"].pipeline_parallel_size) == (decode_tp, 1)
    every = [p for ps in pids.values() for p in ps]
    assert len(placement_groups()) == groups_before
    assert wait_gone(every) == []
    assert segments(every) == set()


def test_a_pipeline_rank_killed_mid_prefill_ends_its_requests_within_the_bound(ray_instance, model):
    """The last pipeline rank dies while long prompts are in prefill: no rank waits for ever on
    its activations (tp_timeout_s), the replica goes down, every request ends (migrated onto the
    replacement, or with an error), and the cluster serves again."""
    spec = _spec(model, {"pipeline_parallel_size": 2, "max_num_batched_tokens": 32}, 1, "grpc")
    spec["prefill"]["tp_timeout_s"] = 5.0
    long_prompts = random_prompts(6, 2000, [400], seed=7)  # (the model's context is 512)
    with running_cluster(spec) as rc:
        victim = rank_pids(rc, "prefill-0")[1]
        results: dict[int, object] = {}
        ends: dict[int, float] = {}

        def one(i):
            try:
                results[i] = list(rc.client.generate(token_ids=long_prompts[i], max_tokens=4, temperature=0,
                                                     ignore_eos=True).token_ids)
            except Exception as e:  # noqa: BLE001 - asserted below
                results[i] = e
            ends[i] = time.monotonic()

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(long_prompts))]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while {r.replica_id: r for r in rc.client.status().replicas}["prefill-0"].num_queued_prefill_tokens < 400:
            assert time.monotonic() < deadline, "the prompts did not queue on the prefill replica"
            time.sleep(0.02)
        t_fault = time.monotonic()  # mid-prefill: most of the prompts' 32-token chunks still to run
        os.kill(victim, signal.SIGKILL)
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads), "a request hung"
        assert len(results) == len(long_prompts)
        # each ends with its tokens (migrated onto the replacement) or an error naming the loss
        assert all(isinstance(r, Exception) or len(r) == 4 for r in results.values()), results
        for i in results:
            assert ends[i] - t_fault < 90, f"request {i} ended {ends[i] - t_fault:.1f} s after the fault"
        # the replica is replaced whole and serves again
        deadline = time.monotonic() + 90
        while True:
            try:
                out = rc.client.generate(token_ids=long_prompts[0][:20], max_tokens=2, temperature=0)
                break
            except Exception:  # noqa: BLE001 - the replacement may still be starting
                assert time.monotonic() < deadline, "the prefill replica was not replaced"
                time.sleep(1)
        assert len(out.token_ids) == 2
        assert victim not in rank_pids(rc, "prefill-0")
        assert {r.replica_id: r for r in rc.client.status().replicas}["prefill-0"].num_restarts >= 1
        assert rc.wait_pools_free(timeout_s=30) == {rid: True for rid in rc.cluster.actors}
