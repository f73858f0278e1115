"""Small factories for engine tests: tiny random Hugging Face models."""
from __future__ import annotations

from pathlib import Path

import torch

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


def tiny_hf_config(kind: str, **overrides):
    import transformers

    cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
           "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}[kind]
    kw = dict(TINY, **overrides)
    if kind == "qwen3":
        kw.setdefault("head_dim", 16)  # != hidden / heads, so head_dim must come from config
    return cls(**kw)


def save_tiny_model(folder: Path, kind: str = "llama", save_kw: dict | None = None, **overrides):
    """A tiny random model saved with save_pretrained; returns its state dict."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_hf_config(kind, **overrides))
    model.save_pretrained(folder, **(save_kw or {}))
    return model.state_dict()
