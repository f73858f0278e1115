"""Greedy output of the engine equals the transformers implementation on the same weights."""
from __future__ import annotations

import pytest
import torch

from engine.llm import LLM
from engine.sampling import SamplingParams
from tests.engine.factories import hf_greedy_mismatch, random_prompts, tiny_llm

GREEDY = dict(temperature=0.0, ignore_eos=True)

ARCHS = {
    "llama": ("llama", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama3-rope": ("llama", {"rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}}),
    "mistral": ("mistral", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "mha": ("llama", {"num_key_value_heads": 4}),
}


@pytest.mark.parametrize("name", sorted(ARCHS))
def test_tiny_models_match_transformers(tmp_path, name):
    from transformers import AutoModelForCausalLM

    kind, over = ARCHS[name]
    llm = tiny_llm(tmp_path, kind, llm_kw={"max_num_batched_tokens": 64}, **over)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    prompts = random_prompts(4, 96, [5, 23, 40, 1], seed=1)
    outs = llm.generate(prompts, SamplingParams(max_tokens=40, **GREEDY))
    for p, o in zip(prompts, outs):
        assert len(o.token_ids) == 40 and o.finish_reason == "length"
        assert hf_greedy_mismatch(hf, p, o.token_ids) is None, f"{name}: diverged from transformers"
    assert llm.core.pool.is_fully_free()


def test_mismatch_detector_catches_a_wrong_token(tmp_path):
    from transformers import AutoModelForCausalLM

    llm = tiny_llm(tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    p = random_prompts(1, 96, [9])[0]
    out = llm.generate(p, SamplingParams(max_tokens=8, **GREEDY))[0].token_ids
    wrong = out[:3] + [(out[3] + 1) % 96] + out[4:]
    assert hf_greedy_mismatch(hf, p, wrong) == 3


@pytest.fixture(scope="module")
def smol_fp32(default_model_dir):
    return LLM(str(default_model_dir), dtype="float32", num_kv_blocks=512)


CHAT = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three primary colors."}],
]
RAW = ["The quick brown fox", "def fibonacci(n):", "Once upon a time, in a land far away,"]


def test_default_model_matches_transformers_generate(smol_fp32, default_model_dir):
    """SmolLM2-135M-Instruct, fp32: our greedy tokens equal transformers' generate()."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    tok = smol_fp32.tokenizer
    prompts = [tok.encode(tok.apply_chat_template(m), add_special_tokens=False) for m in CHAT]
    prompts += [tok.encode(t) for t in RAW]
    outs = smol_fp32.generate(prompts, SamplingParams(max_tokens=32, **GREEDY))
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=32, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        assert o.token_ids == ref, tok.decode(p)
    assert smol_fp32.core.pool.is_fully_free()


def test_default_model_chat_answers(smol_fp32):
    out = smol_fp32.chat(CHAT[0], SamplingParams(max_tokens=24, temperature=0))[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"  # the model ends its turn with <|im_end|>
