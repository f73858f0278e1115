"""Pipeline parallelism on CUDA: the stages' hand-offs go rank to rank over NCCL point-to-point
(engine.parallel.pipe.DistLinks), the hidden states and the logits rows staying on the GPUs.
PP=2 (and PP=2 x TP=2, the stages' all-reduces in their own NCCL groups) decodes PP=1's greedy
fp32 tokens, with two micro-batches in flight and the chunks of a long prompt following each
other down the pipeline. Runs only where 2 GPUs are visible (PP=2 x TP=2: 4)."""
from __future__ import annotations

import pytest
import torch

from engine.llm import LLM
from engine.sampling import SamplingParams
from tests.engine.factories import random_prompts, save_tiny_model

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (one per rank)")]

CUDA = dict(dtype="float32", device="cuda", num_kv_blocks=128, max_num_batched_tokens=64)
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama-pp")
    save_tiny_model(folder, "llama", num_hidden_layers=4, max_position_embeddings=512)
    prompts = random_prompts(16, 96, [3, 9, 17, 30, 70], seed=3)
    with LLM(str(folder), **CUDA) as ref:
        want = [o.token_ids for o in ref.generate(prompts, GREEDY)]
    return folder, prompts, want


def generate(folder, prompts, **kw) -> list[list[int]]:
    with LLM(str(folder), **{**CUDA, **kw}) as llm:
        group = llm.core.tp_group
        assert group.pipe.links is not None and group.pipe.links.backend == "nccl"
        assert group.layout.act_bytes == 0  # no hand-off slots in the segment: the payloads go over NCCL
        out = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        assert llm.core.is_idle() and llm.core.pool.is_fully_free()
        return out


def test_pp2_on_nccl_decodes_pp1s_greedy_tokens(tiny):
    folder, prompts, want = tiny
    assert generate(folder, prompts[:4], pipeline_parallel_size=2) == want[:4]


def test_pp2_on_nccl_with_16_streams_in_two_micro_batches(tiny):
    """Two batches of 8 in flight: rank 0 sends batch k + 1's hidden states to rank 1 before it
    receives batch k's logits from it, on separate links (one communicator each)."""
    folder, prompts, want = tiny
    assert generate(folder, prompts, pipeline_parallel_size=2, max_num_seqs=16) == want


def test_pp2_on_nccl_pipelined_long_prompt(tiny):
    folder, _, _ = tiny
    prompt = random_prompts(1, 96, [200], seed=4)[0]
    with LLM(str(folder), **{**CUDA, "max_num_batched_tokens": 256}) as ref:
        want = [o.token_ids for o in ref.generate([prompt], GREEDY)]
    assert generate(folder, [prompt], pipeline_parallel_size=2, max_num_batched_tokens=16) == want


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 GPUs (PP=2 x TP=2, one per rank)")
def test_pp2_tp2_on_nccl_decodes_pp1s_greedy_tokens(tiny):
    folder, prompts, want = tiny
    out = generate(folder, prompts, pipeline_parallel_size=2, pipeline_layer_split=[1, 3], tensor_parallel_size=2,
                   max_num_seqs=16)
    assert out == want


def test_pp_on_cuda_with_a_host_memory_backend_is_refused(tiny):
    from engine.config import ConfigError

    folder, _, _ = tiny
    with pytest.raises(ConfigError, match="tp_backend: gloo hands the stages' activations on through host memory"):
        LLM(str(folder), **CUDA, pipeline_parallel_size=2, tp_backend="gloo")
