"""A colocated TP=2 replica whose all-reduces go through gloo (torch.distributed over TCP,
meeting at rank 0) instead of shared memory: the ranks are Ray actors all the same, and its
greedy output is engine.LLM's at TP=1, token for token, with the pool free afterwards."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from engine.llm import LLM
from engine.sampling import SamplingParams
from tests.e2e.conftest import SLICE, running_cluster
from tests.engine.factories import random_prompts, save_tiny_model_with_tokenizer

GREEDY = dict(max_tokens=10, temperature=0, ignore_eos=True)


def test_colocated_tp2_over_gloo_equals_engine_tp1(ray_instance, tmp_path, default_model_dir):
    save_tiny_model_with_tokenizer(tmp_path, default_model_dir)
    prompts = random_prompts(6, 2000, [7, 30])
    llm = LLM(str(tmp_path), dtype="float32", num_kv_blocks=64)
    want = [o.token_ids for o in llm.generate(prompts, SamplingParams(**GREEDY))]
    spec = {"model": str(tmp_path), "mode": "colocated",
            "colocated": {"replicas": 1, "tensor_parallel_size": 2, "tp_backend": "gloo", "resources": SLICE,
                          "num_kv_blocks": 64, "max_num_batched_tokens": 256}}
    with running_cluster(spec) as rc:
        with ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(lambda p: list(rc.client.generate(token_ids=p, **GREEDY).token_ids), prompts))
        assert got == want
        (status,) = rc.client.status().replicas
        assert status.tensor_parallel_size == 2 and len(set(status.rank_pids)) == 2
        assert rc.wait_pools_free() == {"colocated-0": True}
