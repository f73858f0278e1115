"""GGUF file -> Hugging Face style checkpoint folder, done once and cached.

1. Read the file with `gguf.GGUFReader`; build a ``config.json`` from its
   ``{arch}.*`` metadata.
2. Dequantize every tensor to float32 with `gguf.quants.dequantize`, rename it
   from llama.cpp's names to Hugging Face's Llama names, and undo the row
   permutation llama.cpp applies to the q and k projections of llama-arch
   models (see `unpermute_qk`). A mixture of experts (qwen2moe, qwen3moe, and
   llama-arch files with an ``expert_count``: Mixtral) stores each sparse
   layer's experts stacked, ``blk.N.ffn_{gate,up,down}_exps`` [E, ...]: they
   are split into the per-expert names engine.moe takes
   (``mlp.experts.{j}.gate_proj.weight`` ...), beside the router
   (``ffn_gate_inp``) and Qwen2-MoE's shared expert (``ffn_*_shexp``).
3. Build the tokenizer from the file's embedded vocabulary with transformers'
   GGUF support and save it (``tokenizer.json``, ``tokenizer_config.json``
   with the chat template).
4. Write it all into a temporary folder next to the cache entry and rename it
   into place, so workers converting the same file at once never see a
   half-written folder.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from engine.config import ConfigError, ModelConfig
from engine.weights import SAFETENSORS_FILE, CheckpointError, expected_shapes

logger = logging.getLogger(__name__)

# Bump when the folder a conversion writes changes, so stale cache entries are not reused.
CONVERTER_VERSION = 1

# GGUF general.architecture -> (HF architectures[0], HF model_type)
GGUF_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
}
# a llama-arch file with experts (expert_count > 0) is a Mixtral
LLAMA_MOE_ARCHITECTURE = ("MixtralForCausalLM", "mixtral")
# llama.cpp stores q and k of these architectures (HF model_type) with rope pairs interleaved.
PERMUTED_QK_ARCHITECTURES = {"llama", "mixtral"}

GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    # a sparse layer's router and Qwen2-MoE's shared expert with its gate
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# a sparse layer's experts, stacked [E, out, in] -> each expert's projection (engine.moe.expert_name)
EXPERT_TENSORS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
EXPERTS_RE = re.compile(r"blk\.(\d+)\.(ffn_(?:gate|up|down)_exps)\.weight")
# 2-D tensors that route rather than compute (a router, the shared expert's gate): float32 even
# where quantization "gguf" keeps the matmul weights' blocks (engine.gguf_blocks.read_gguf_rows)
FP32_MATRICES = {"gate", "shared_expert_gate"}
# Tensors HF's implementation has no place for: rope_freqs holds llama3 rope
# scaling factors, which HF derives from config instead.
IGNORED_TENSORS = {"rope_freqs.weight"}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")

_HASH_CHUNK = 1 << 20


def gguf_cache_key(path: Path) -> str:
    """Identifies a GGUF file cheaply: size, mtime and its first and last MiB."""
    st = path.stat()
    h = hashlib.sha256(f"v{CONVERTER_VERSION}:{st.st_size}:{st.st_mtime_ns}".encode())
    with open(path, "rb") as f:
        h.update(f.read(_HASH_CHUNK))
        f.seek(max(0, st.st_size - _HASH_CHUNK))
        h.update(f.read(_HASH_CHUNK))
    return f"{path.stem}-{h.hexdigest()[:16]}"


def convert_gguf_cached(path: Path, cache_root: Path) -> Path:
    """The checkpoint folder for GGUF file `path`, converting it on first use."""
    final = cache_root / gguf_cache_key(path)
    if (final / "config.json").is_file():
        return final
    cache_root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=cache_root))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp's 0700 would hide the cache from other users
        convert_gguf(path, tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "config.json").is_file():
                raise
            # Another worker converted the same file first; use its folder.
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def open_gguf(path: Path):
    """GGUF file `path`'s reader and its config.json dict, its expert tensors checked; a
    CheckpointError naming the file where it cannot be read."""
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # the reader raises bare ValueError/struct errors on bad files
        raise CheckpointError(f"{path}: not a readable GGUF file ({e})") from e
    config = gguf_config(reader, path)
    check_expert_tensors(reader, path, config)
    return reader, config


def convert_gguf(path: Path, out: Path) -> None:
    """Write config.json, model.safetensors (float32) and the tokenizer of GGUF `path` into `out`."""
    reader, config = open_gguf(path)
    tensors = gguf_tensors(reader, path, config)

    model_cfg = ModelConfig.from_hf_dict(config)
    shapes = expected_shapes(model_cfg)
    if model_cfg.tie_word_embeddings:
        shapes.pop("lm_head.weight")
    for name, shape in shapes.items():
        if name not in tensors:
            raise CheckpointError(f"{path}: tensor for {name!r} is missing")
        if tuple(tensors[name].shape) != shape:
            raise CheckpointError(
                f"{path}: tensor {name!r} has shape {list(tensors[name].shape)}, expected {list(shape)}"
            )

    save_file(tensors, str(out / SAFETENSORS_FILE), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if "tokenizer.ggml.model" in reader.fields:
        write_tokenizer(path, out, chat_template=_field(reader, "tokenizer.chat_template"))


def _field(reader, key: str, default: Any = None) -> Any:
    """A scalar or string metadata value (arrays are not needed here)."""
    import gguf

    f = reader.fields.get(key)
    if f is None:
        return default
    kind = f.types[0]
    if kind == gguf.GGUFValueType.ARRAY:
        raise ConfigError(f"GGUF metadata {key}: expected a single value, got an array")
    value = f.parts[f.data[0]]
    if kind == gguf.GGUFValueType.STRING:
        return bytes(value).decode("utf-8")
    return value.tolist()[0]


def gguf_config(reader, path: Path) -> dict[str, Any]:
    """A Hugging Face config.json dict from a GGUF file's metadata."""
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ConfigError(
            f"{path}: GGUF architecture {arch!r} is not supported; supported: {sorted(GGUF_ARCHITECTURES)}"
        )
    hf_arch, model_type = GGUF_ARCHITECTURES[arch]
    if arch == "llama" and (_field(reader, "llama.expert_count", 0) or 0) > 0:
        hf_arch, model_type = LLAMA_MOE_ARCHITECTURE

    def get(key: str, default: Any = ...) -> Any:
        value = _field(reader, f"{arch}.{key}", None)
        if value is None:
            if default is ...:
                raise ConfigError(f"{path}: GGUF metadata {arch}.{key} is missing")
            return default
        return value

    tensor_dims = {t.name: [int(d) for d in reversed(t.shape)] for t in reader.tensors}
    if "token_embd.weight" not in tensor_dims:
        raise CheckpointError(f"{path}: tensor 'token_embd.weight' is missing")
    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    config: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "vocab_size": int(get("vocab_size", tensor_dims["token_embd.weight"][0])),
        "hidden_size": hidden,
        # (a mixture of experts without dense layers may leave it out: the experts' size then)
        "intermediate_size": int(get("feed_forward_length", None) or get("expert_feed_forward_length", None)
                                 or get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in tensor_dims,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    if arch == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in tensor_dims
    config.update(_moe_config(model_type, get, tensor_dims, config["num_hidden_layers"]))
    scaling = get("rope.scaling.type", None)
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise ConfigError(f"{path}: GGUF rope scaling {scaling!r} is not supported")
        config["rope_scaling"] = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    if "rope_freqs.weight" in tensor_dims:
        logger.warning("%s: ignoring rope_freqs (llama3 rope scaling); long contexts may degrade", path)

    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    eos = [_field(reader, "tokenizer.ggml.eos_token_id"), _field(reader, "tokenizer.ggml.eot_token_id")]
    eos = list(dict.fromkeys(int(e) for e in eos if e is not None))
    if bos is not None:
        config["bos_token_id"] = int(bos)
    if eos:
        config["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    return config


def _moe_config(model_type: str, get, tensor_dims: dict[str, list[int]], num_layers: int) -> dict[str, Any]:
    """The HF mixture-of-experts fields from the ``{arch}.expert_*`` metadata (none for a dense file).
    A layer is sparse where the file holds any of its router or stacked experts, dense otherwise."""
    experts = int(get("expert_count", 0) or 0)
    if not experts:
        return {}
    top_k = int(get("expert_used_count"))
    if model_type == "mixtral":  # every layer sparse, the experts of feed_forward_length
        return {"num_local_experts": experts, "num_experts_per_tok": top_k}
    sparse = [i for i in range(num_layers)
              if any(f"blk.{i}.{t}.weight" in tensor_dims for t in ("ffn_gate_inp", *EXPERT_TENSORS))]
    out = {"num_experts": experts, "num_experts_per_tok": top_k,
           "moe_intermediate_size": int(get("expert_feed_forward_length")),
           # llama.cpp renormalizes Qwen3-MoE's top-k weights and not Qwen2-MoE's unless the file says
           "norm_topk_prob": bool(get("expert_weights_norm", model_type == "qwen3_moe")),
           "decoder_sparse_step": 1, "mlp_only_layers": [i for i in range(num_layers) if i not in sparse]}
    if model_type == "qwen2_moe":
        out["shared_expert_intermediate_size"] = int(get("expert_shared_feed_forward_length", 0))
    return out


def expert_tensor_name(match: re.Match, expert: int) -> str:
    """The per-expert HF name of expert `expert` of a stacked tensor matched by EXPERTS_RE."""
    from engine.moe import expert_name

    return expert_name(int(match.group(1)), expert, EXPERT_TENSORS[match.group(2)])


def check_expert_tensors(reader, path: Path, config: dict[str, Any]) -> None:
    """Raise CheckpointError naming the first GGUF tensor a sparse layer lacks (its router, a stacked
    expert projection, a shared expert's), or a stacked expert tensor whose expert count is wrong."""
    model_cfg = ModelConfig.from_hf_dict(config)
    if not model_cfg.is_moe:
        return
    dims = {t.name: [int(d) for d in reversed(t.shape)] for t in reader.tensors}
    wanted = ["ffn_gate_inp", *EXPERT_TENSORS]
    if model_cfg.shared_expert_intermediate_size:
        wanted += ["ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp", "ffn_gate_inp_shexp"]
    for i in model_cfg.moe_layers:
        for t in wanted:
            key = f"blk.{i}.{t}.weight"
            if key not in dims:
                raise CheckpointError(f"{path}: tensor {key!r} is missing (layer {i} is a mixture of experts)")
            if t in EXPERT_TENSORS and (len(dims[key]) != 3 or dims[key][0] != model_cfg.num_experts):
                raise CheckpointError(f"{path}: tensor {key!r} has shape {dims[key]}, expected "
                                      f"[{model_cfg.num_experts}, ...] (one matrix per expert)")


def unpermute_qk(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation.

    llama.cpp stores each head's rows with rope pairs interleaved
    (row 2*i + j holds HF row j * head_dim/2 + i); HF keeps the two rotary
    halves apart. w: [num_heads * head_dim, ...] (a weight or a bias).
    """
    head_dim = w.shape[0] // num_heads
    return w.reshape(num_heads, head_dim // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def hf_tensor_name(gguf_name: str) -> str | None:
    """The HF name of a llama.cpp tensor name; None for tensors HF does not use."""
    if gguf_name in IGNORED_TENSORS:
        return None
    base, _, suffix = gguf_name.rpartition(".")
    if base in GLOBAL_TENSORS and suffix in ("weight", "bias"):
        return f"{GLOBAL_TENSORS[base]}.{suffix}"
    m = _LAYER_RE.fullmatch(gguf_name)
    if m and m.group(2) in LAYER_TENSORS:
        return f"model.layers.{m.group(1)}.{LAYER_TENSORS[m.group(2)]}.{m.group(3)}"
    raise CheckpointError(f"GGUF tensor {gguf_name!r} has no counterpart in a Llama-family model")


def gguf_tensors(reader, path: Path, config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Every tensor of the file, dequantized to float32, under its HF name and layout."""
    from gguf.quants import dequantize

    permuted = config["model_type"] in PERMUTED_QK_ARCHITECTURES
    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        experts = EXPERTS_RE.fullmatch(t.name)
        name = None if experts else hf_tensor_name(t.name)
        if name is None and not experts:
            continue
        try:
            values = dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise CheckpointError(
                f"{path}: tensor {t.name!r} is stored as {t.tensor_type.name}, which gguf cannot dequantize"
            ) from e
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims fastest-first
        w = torch.from_numpy(np.array(values, dtype=np.float32).reshape(shape))
        if experts:  # [E, out, in]: one tensor per expert
            for e in range(shape[0]):
                tensors[expert_tensor_name(experts, e)] = w[e].clone()
            continue
        if name.endswith(".shared_expert_gate.weight"):
            w = w.reshape(1, -1)  # llama.cpp may store the shared expert's gate as a vector
        if permuted and ".self_attn.q_proj." in name:
            w = unpermute_qk(w, config["num_attention_heads"])
        elif permuted and ".self_attn.k_proj." in name:
            w = unpermute_qk(w, config["num_key_value_heads"])
        tensors[name] = w.contiguous()
    return tensors


def write_tokenizer(path: Path, out: Path, chat_template: str | None) -> None:
    """tokenizer.json and tokenizer_config.json, built by transformers from the GGUF vocabulary."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tokenizer.save_pretrained(str(out))
    config_path = out / "tokenizer_config.json"
    tok_config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    if chat_template is not None:
        tok_config["chat_template"] = chat_template
    for key in ("bos_token", "eos_token"):
        value = getattr(tokenizer, key, None)
        if value is not None:
            tok_config[key] = str(value)
    config_path.write_text(json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n")
