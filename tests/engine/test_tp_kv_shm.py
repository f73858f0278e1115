"""Each worker rank's KV cache lives in shared memory that rank 0 maps (TPGroup.rank_kv_caches): the files are
unlinked once every rank mapped them, the mapped tensors are the ranks' own caches, and a cache /dev/shm cannot
hold is refused at start with the sizes named."""
from __future__ import annotations

import os

import pytest
import torch

from engine.kv_cache import KVCacheSpec
from engine.llm import LLM
from engine.parallel.comm import CollectiveError
from engine.parallel.kv_shm import create_kv_segment, kv_cache_bytes, map_kv_cache
from engine.parallel.shm import SEGMENT_PREFIX, SHM_DIR
from engine.sampling import SamplingParams
from tests.engine.factories import random_prompts, save_tiny_model

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def own_segments() -> set[str]:
    """This process's (other sessions on the machine make their own)."""
    return {n for n in os.listdir(SHM_DIR) if n.startswith(f"{SEGMENT_PREFIX}{os.getpid()}-")}


def test_rank_0_maps_every_ranks_cache_and_no_file_is_left(tmp_path):
    save_tiny_model(tmp_path, "llama")  # 2 KV heads: one per rank at TP=2
    before = own_segments()
    prompts = random_prompts(2, 96, [20, 7], seed=5)
    with LLM(str(tmp_path), dtype="float32", num_kv_blocks=16) as ref:
        want = [o.token_ids for o in ref.generate(prompts, GREEDY)]
    with LLM(str(tmp_path), dtype="float32", num_kv_blocks=16, tensor_parallel_size=2) as llm:
        assert own_segments() == before  # unlinked once every rank mapped its cache
        ranks = llm.core.tp_group.rank_kv_caches()
        assert [len(r) for r in ranks] == [2, 2] and ranks[0] is not ranks[1]
        assert ranks[0][0] is llm.core.kv_caches[0]
        assert all(t.shape == (16, 2, 16, 1, 8) for r in ranks for t in r)
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == want
        assert any(t.any() for t in ranks[1]), "rank 1's cache, as rank 0 maps it, holds none of its KV"
        # what rank 0 writes into rank 1's mapping is what rank 1 attends over: garbage there changes tokens
        for t in ranks[1]:
            t.normal_()
        again = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        assert again != want
        group = llm.core.tp_group
    with pytest.raises(CollectiveError, match="down"):
        group.rank_kv_caches()
    assert own_segments() == before


def test_a_cache_that_dev_shm_cannot_hold_is_refused_with_the_sizes(tmp_path):
    spec = KVCacheSpec(num_layers=30, num_kv_heads=8, head_dim=128, block_size=16, dtype="float32")
    path = os.path.join(SHM_DIR, f"{SEGMENT_PREFIX}{os.getpid()}-test-kv1")
    free = os.statvfs(SHM_DIR).f_bavail * os.statvfs(SHM_DIR).f_frsize
    num_blocks = free // spec.bytes_per_block + 1
    with pytest.raises(RuntimeError, match=r"rank 1: its KV cache needs .* MiB of /dev/shm, which has .* MiB free"):
        create_kv_segment(path, spec, num_blocks, 1)
    assert not os.path.exists(path)


def test_a_mapped_cache_is_the_engines_layout(tmp_path):
    spec = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype="bfloat16")
    path = os.path.join(SHM_DIR, f"{SEGMENT_PREFIX}{os.getpid()}-layout-kv1")
    create_kv_segment(path, spec, 5, 1)
    try:
        a, b = map_kv_cache(path, spec, 5), map_kv_cache(path, spec, 5)
        assert os.path.getsize(path) == kv_cache_bytes(spec, 5)
    finally:
        os.unlink(path)
    assert [t.shape for t in a] == [(5, 2, 4, 2, 8)] * 3 and a[0].dtype == torch.bfloat16
    a[2][4, 1, 3, 1].fill_(1.5)  # two mappings of one file: one memory
    assert b[2][4, 1, 3, 1].tolist() == [1.5] * 8 and not b[1].any()
