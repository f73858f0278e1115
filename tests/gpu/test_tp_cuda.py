"""Tensor parallelism on CUDA (NCCL collectives, a GPU per rank): TP=2 decodes TP=1's greedy fp32
tokens; rank 0's views of the other ranks' caches (CUDA IPC) are those caches; a prefill at TP=2
hands its KV to a decode at TP=1 token-exact; a colocated TP=2 replica over Ray, a GPU per
rank's bundle, serves the same tokens; and disaggregated over Ray with prefill and decode at
different TP sizes (rank 0 of each replica opens its other ranks' caches on their GPUs), over
both transports. Runs only where at least 2 GPUs are visible (the disaggregated cases: 3 or 4)."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from engine.llm import LLM
from engine.sampling import SamplingParams
from kvtransfer.layout import engine_kv
from tests.engine.factories import random_prompts, save_tiny_model, save_tiny_model_with_tokenizer
from tests.kvtransfer.test_hetero import ENGINE, GREEDY, LENGTHS, disaggregated

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (one per rank)")]

CUDA = dict(ENGINE, device="cuda")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_model(folder, "llama")  # 4 heads, 2 KV heads: one per rank at TP=2
    prompts = random_prompts(len(LENGTHS), 96, LENGTHS, seed=4)
    with LLM(str(folder), **CUDA) as ref:
        want = [o.token_ids for o in ref.generate(prompts, GREEDY)]
    return folder, prompts, want


def test_tp2_on_cuda_decodes_tp1s_greedy_tokens(tiny):
    folder, prompts, want = tiny
    with LLM(str(folder), tensor_parallel_size=2, **CUDA) as llm:
        assert llm.core.tp_group.comm.backend == "nccl"
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == want
        assert llm.core.runner.graphs is None  # off at TP>1 (engine/core.py says why)
        assert llm.core.pool.is_fully_free()


def test_rank_0s_views_are_the_ranks_caches_on_their_gpus(tiny):
    folder, prompts, want = tiny
    with LLM(str(folder), tensor_parallel_size=2, **CUDA) as llm:
        ranks = llm.core.tp_group.rank_kv_caches()
        assert [t.device for t in ranks[0]] == [torch.device("cuda:0")] * len(ranks[0])
        assert [t.device for t in ranks[1]] == [torch.device("cuda:1")] * len(ranks[1])
        assert [o.token_ids for o in llm.generate(prompts[:1], GREEDY)] == want[:1]
        assert any(t.any() for t in ranks[1]), "rank 1's cache, as rank 0 sees it, holds none of its KV"
        # the prompt's full blocks are cached: spoil rank 1's copy through rank 0's view, and the next
        # request for it (a prefix hit, read by rank 1's own step) must come out different
        for t in ranks[1]:
            t.fill_(100.0)
        torch.cuda.synchronize()
        assert [o.token_ids for o in llm.generate(prompts[:1], GREEDY)] != want[:1]
        assert llm.core.pool.is_fully_free()


def test_prefill_tp2_to_decode_tp1_on_cuda_is_token_exact(tiny):
    folder, prompts, want = tiny
    with LLM(str(folder), tensor_parallel_size=2, **CUDA) as prefill, LLM(str(folder), **CUDA) as decode:
        assert len(engine_kv(prefill.core)[1]) == 2
        got = disaggregated(prefill, decode, prompts, "nccl", tag="cuda")
        assert got == want
        assert prefill.core.pool.is_fully_free() and decode.core.pool.is_fully_free()


def test_colocated_tp2_over_ray_with_a_gpu_per_rank(ray_instance, tmp_path, default_model_dir):
    from tests.e2e.conftest import running_cluster

    save_tiny_model_with_tokenizer(tmp_path, default_model_dir)
    prompts = random_prompts(6, 2000, [7, 30])
    params = dict(max_tokens=10, temperature=0, ignore_eos=True)
    with LLM(str(tmp_path), dtype="float32", device="cuda", num_kv_blocks=64) as llm:
        want = [o.token_ids for o in llm.generate(prompts, SamplingParams(**params))]
    spec = {"model": str(tmp_path), "mode": "colocated", "dtype": "float32",
            "colocated": {"replicas": 1, "tensor_parallel_size": 2, "resources": {"num_cpus": 0.25, "num_gpus": 1},
                          "num_kv_blocks": 64, "max_num_batched_tokens": 256}}
    with running_cluster(spec) as rc:
        with ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(lambda p: list(rc.client.generate(token_ids=p, **params).token_ids), prompts))
        assert got == want
        (status,) = rc.client.status().replicas
        assert status.tensor_parallel_size == 2 and len(set(status.rank_pids)) == 2
        assert rc.wait_pools_free() == {"colocated-0": True}


@pytest.mark.parametrize("prefill_tp, decode_tp, backend", [
    (2, 1, "nccl"), (1, 2, "nccl"), (2, 1, "grpc"), (2, 2, "nccl")])
def test_disaggregated_tp_over_ray_with_a_gpu_per_rank(ray_instance, tmp_path, default_model_dir,
                                                       prefill_tp, decode_tp, backend):
    from tests.e2e.conftest import running_cluster

    if torch.cuda.device_count() < prefill_tp + decode_tp:
        pytest.skip(f"needs {prefill_tp + decode_tp} GPUs (one per rank of both replicas)")
    save_tiny_model_with_tokenizer(tmp_path, default_model_dir, num_attention_heads=4, num_key_value_heads=2,
                                   hidden_size=32, intermediate_size=64)
    prompts = random_prompts(16, 2000, [5, 19, 33, 40])
    params = dict(max_tokens=12, temperature=0, ignore_eos=True)
    with LLM(str(tmp_path), dtype="float32", device="cuda", num_kv_blocks=128) as llm:
        want = [o.token_ids for o in llm.generate(prompts, SamplingParams(**params))]
    stage = {"replicas": 1, "resources": {"num_cpus": 0.25, "num_gpus": 1}, "num_kv_blocks": 64, "tp_timeout_s": 30.0}
    spec = {"model": str(tmp_path), "mode": "disaggregated", "dtype": "float32",
            "prefill": dict(stage, tensor_parallel_size=prefill_tp, max_num_batched_tokens=256),
            "decode": dict(stage, tensor_parallel_size=decode_tp),
            "transfer": {"backend": backend, "options": {"lease_s": 20, "deadline_s": 30}}}
    with running_cluster(spec) as rc:
        with ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(lambda p: list(rc.client.generate(token_ids=p, **params).token_ids), prompts))
        for i, (g, w) in enumerate(zip(got, want)):
            assert g == w, f"request {i} at prefill TP={prefill_tp} -> decode TP={decode_tp} ({backend}) on GPUs"
        status = {r.replica_id: r for r in rc.client.status().replicas}
        assert [len(set(status[r].rank_pids)) for r in ("prefill-0", "decode-0")] == [prefill_tp, decode_tp]
        assert rc.wait_pools_free() == {"prefill-0": True, "decode-0": True}
