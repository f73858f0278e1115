"""Tensor parallelism: greedy fp32 output at TP=N equals TP=1's and transformers', token for token."""
from __future__ import annotations

import pytest
import torch

from engine.llm import LLM
from engine.sampling import SamplingParams
from tests.engine.factories import hf_greedy_mismatch, random_prompts, save_tiny_model

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)

# name: (kind, checkpoint overrides, tp, engine overrides). TINY has 4 heads, 2 KV heads.
CASES = {
    # chunked prefill beside decodes, and a cache small enough to preempt (block tables replaced)
    "llama-gqa-preempt": ("llama", {}, 2, {"num_kv_blocks": 7, "max_num_batched_tokens": 32}),
    "llama-kv-replicated-tied-odd-vocab": ("llama", {"tie_word_embeddings": True, "vocab_size": 95}, 4, {}),
    "qwen2-qkv-bias": ("qwen2", {}, 2, {}),
    "qwen3-qk-norm-kv-replicated": ("qwen3", {}, 4, {}),
    "mistral": ("mistral", {}, 2, {}),
    "mha": ("llama", {"num_key_value_heads": 4}, 2, {}),
    "llama-gloo": ("llama", {}, 2, {"tp_backend": "gloo"}),
}


def generate(folder, prompts, **kw) -> list[list[int]]:
    with LLM(str(folder), dtype="float32", **dict({"num_kv_blocks": 64, "max_num_batched_tokens": 64}, **kw)) as llm:
        outs = llm.generate(prompts, GREEDY)
        assert llm.core.pool.is_fully_free()
        if llm.core.tp_group is not None:
            assert len(llm.core.tp_group.pids) == llm.core.config.tensor_parallel_size - 1
        return [o.token_ids for o in outs]


@pytest.mark.parametrize("name", sorted(CASES))
def test_tp_greedy_equals_tp1_and_transformers(tmp_path, name):
    from transformers import AutoModelForCausalLM

    kind, over, tp, engine_kw = CASES[name]
    save_tiny_model(tmp_path, kind, **over)
    vocab = over.get("vocab_size", 96)
    prompts = random_prompts(4, vocab, [5, 23, 40, 1], seed=1)
    ref = generate(tmp_path, prompts, **engine_kw)
    out = generate(tmp_path, prompts, tensor_parallel_size=tp, **engine_kw)
    assert out == ref, f"{name}: TP={tp} diverged from TP=1"
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    for p, o in zip(prompts, out):
        assert hf_greedy_mismatch(hf, p, o) is None, f"{name}: TP={tp} diverged from transformers"


def greedy_mismatch(ref: LLM, prompt: list[int], output: list[int], margin: float) -> int | None:
    """The first position where `output` is not `ref`'s greedy choice (teacher-forced on
    prompt + output[:j]), ignoring near-ties: logprobs closer than `margin`. None: it agrees."""
    forced = ref.generate([prompt + output[:j] for j in range(len(output))],
                          SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=4))
    for j, (tok, o) in enumerate(zip(output, forced)):
        top = dict(o.logprobs[0]["top"])
        if tok != o.token_ids[0] and (tok not in top or top[o.token_ids[0]] - top[tok] > margin):
            return j
    return None


def test_tp_bf16_native_ops_run_the_shards(tmp_path):
    """bf16 at TP=2 runs the per-op path on the shards (NativeOps where the CPU has the kernels;
    FusedDecoder cannot all-reduce inside its one call). Partial sums are rounded to bf16 before
    the all-reduce, so near-ties may break the other way than at TP=1: every token must be
    TP=1's greedy choice up to bf16 rounding."""
    save_tiny_model(tmp_path, "llama", initializer_range=0.2)  # peaked logits: a wrong sum shows
    prompts = random_prompts(3, 96, [7, 30], seed=2)
    with LLM(str(tmp_path), dtype="bfloat16", num_kv_blocks=64, tensor_parallel_size=2) as llm:
        assert llm.core.model.fused is None
        out = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        assert llm.core.pool.is_fully_free()
    with LLM(str(tmp_path), dtype="bfloat16", num_kv_blocks=256) as ref:
        for p, o in zip(prompts, out):
            assert greedy_mismatch(ref, p, o, margin=0.05) is None


@pytest.mark.slow
def test_default_model_tp3_equals_tp1(default_model_dir):
    """SmolLM2-135M (9 heads, 3 KV heads) split three ways: one KV head per rank."""
    prompts = ["The quick brown fox", "def fibonacci(n):", "Once upon a time, in a land far away,"]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    with LLM(str(default_model_dir), dtype="float32", num_kv_blocks=32) as llm:
        ref = [o.token_ids for o in llm.generate(prompts, params)]
    with LLM(str(default_model_dir), dtype="float32", num_kv_blocks=32, tensor_parallel_size=3) as llm:
        assert llm.core.kv_spec.num_kv_heads == 1
        out = [o.token_ids for o in llm.generate(prompts, params)]
        assert llm.core.pool.is_fully_free()
    assert out == ref
