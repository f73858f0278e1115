"""Small factories for engine tests: tiny random Hugging Face models."""
from __future__ import annotations

from pathlib import Path

import torch

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


# 4 experts, top-2; Qwen2-MoE's shared expert of its own size; Qwen3-MoE's second layer dense;
# OLMoE's experts of intermediate_size, its q/k norms over the full width
MOE_TINY = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                      mlp_only_layers=[1]),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2, norm_topk_prob=False),
}


def tiny_hf_config(kind: str, **overrides):
    import transformers

    cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
           "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
           "mixtral": transformers.MixtralConfig, "qwen2_moe": transformers.Qwen2MoeConfig,
           "qwen3_moe": transformers.Qwen3MoeConfig, "olmoe": transformers.OlmoeConfig}[kind]
    kw = {**TINY, **MOE_TINY.get(kind, {}), **overrides}
    if kind in ("qwen3", "qwen3_moe"):
        kw.setdefault("head_dim", 16)  # != hidden / heads, so head_dim must come from config
    return cls(**kw)


def save_tiny_model(folder: Path, kind: str = "llama", save_kw: dict | None = None, **overrides):
    """A tiny random model saved with save_pretrained; returns its state dict."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_hf_config(kind, **overrides))
    model.save_pretrained(folder, **(save_kw or {}))
    return model.state_dict()


def tiny_llm(folder: Path, kind: str = "llama", llm_kw: dict | None = None, **overrides):
    """An engine.LLM over a freshly saved tiny random model, in float32."""
    from engine.llm import LLM

    save_tiny_model(folder, kind, **overrides)
    return LLM(str(folder), **dict({"dtype": "float32", "num_kv_blocks": 256}, **(llm_kw or {})))


def rand_bf16(*shape, seed=0):
    """A bf16 tensor of `shape` drawn from N(0, 1), the same for the same seed."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


def random_prompts(n: int, vocab: int, lengths, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(n)]


def hf_greedy_mismatch(hf_model, prompt: list[int], output: list[int], margin: float = 1e-4):
    """Check `output` is the transformers model's greedy continuation of `prompt`.

    Teacher-forces prompt+output through transformers (no cache) and returns
    the first position where our token is not its argmax, ignoring positions
    where its top two logits are closer than `margin` (a genuine tie that
    float rounding may break either way). None when the outputs agree.
    """
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + output])).logits[0].float()
    for j, tok in enumerate(output):
        row = logits[len(prompt) + j - 1]
        top2 = row.topk(2).values
        if int(row.argmax()) != tok and float(top2[0] - top2[1]) > margin:
            return j
    return None


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def save_tiny_model_with_tokenizer(folder: Path, tokenizer_dir: Path, kind: str = "llama", **overrides):
    """A tiny random llama sized to, and saved with, the tokenizer of
    `tokenizer_dir` (the default model's), so prompts and outputs are text."""
    import json
    import shutil

    vocab = json.loads((Path(tokenizer_dir) / "config.json").read_text())["vocab_size"]
    for name in TOKENIZER_FILES:
        if (Path(tokenizer_dir) / name).is_file():
            shutil.copy(Path(tokenizer_dir) / name, Path(folder) / name)
    return save_tiny_model(folder, kind, **dict({"vocab_size": vocab, "max_position_embeddings": 512}, **overrides))


def tiny_llm_with_tokenizer(folder: Path, tokenizer_dir: Path, llm_kw: dict | None = None, **overrides):
    """An engine.LLM (float32) over `save_tiny_model_with_tokenizer`."""
    from engine.llm import LLM

    save_tiny_model_with_tokenizer(folder, tokenizer_dir, **overrides)
    return LLM(str(folder), **dict({"dtype": "float32", "num_kv_blocks": 256}, **(llm_kw or {})))


def run_ranks(target, size: int, *args) -> dict[int, object]:
    """``target(rank, results, *args)`` in ``size`` spawned processes, each putting ``(rank, value)`` in
    ``results`` (plain lists: a tensor in a queue would be shared memory its exiting sender takes along);
    returns {rank: value} once every process exited 0. Any left running is killed."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, results, *args)) for r in range(size)]
    try:
        for p in procs:
            p.start()
        out = dict(results.get(timeout=120) for _ in range(size))
        for p in procs:
            p.join(30)
            assert p.exitcode == 0
        return out
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
