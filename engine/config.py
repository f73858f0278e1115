"""Typed configuration of a model and of an engine instance.

`ModelConfig` is read once from a checkpoint's ``config.json`` (or built from
GGUF metadata by the weight loader) and validated; every other component gets
the few fields it needs from it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

# HF `architectures[0]` / `model_type` -> our family name.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
MODEL_TYPES = {"llama", "mistral", "qwen2", "qwen3"}


class ConfigError(ValueError):
    """A checkpoint or engine configuration is invalid; the message names the field."""


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # one of MODEL_TYPES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool = False  # RMSNorm on q and k per head (Qwen3)
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        arch = None
        for a in archs:
            if a in SUPPORTED_ARCHITECTURES:
                arch = SUPPORTED_ARCHITECTURES[a]
                break
        if arch is None:
            model_type = cfg.get("model_type")
            if model_type in MODEL_TYPES and not archs:
                arch = model_type
            else:
                raise ConfigError(
                    f"config.json: unsupported architecture {archs or model_type!r}; "
                    f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
                )

        def req(key: str) -> Any:
            if key not in cfg:
                raise ConfigError(f"config.json: missing required field {key!r}")
            return cfg[key]

        hidden = int(req("hidden_size"))
        num_heads = int(req("num_attention_heads"))
        num_kv_heads = int(cfg.get("num_key_value_heads") or num_heads)
        head_dim = int(cfg.get("head_dim") or hidden // num_heads)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        sliding = cfg.get("sliding_window") if cfg.get("use_sliding_window", arch == "mistral") else None
        # transformers >= 5 writes rope settings as `rope_parameters`, older ones as
        # `rope_theta` and `rope_scaling`.
        rope_params = cfg.get("rope_parameters") or {}
        rope_theta = cfg.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        rope_scaling = cfg.get("rope_scaling")
        if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
            rope_scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
        mc = cls(
            architecture=arch,
            vocab_size=int(req("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(req("intermediate_size")),
            num_layers=int(req("num_hidden_layers")),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", arch == "qwen2")),
            qk_norm=arch == "qwen3",
            sliding_window=int(sliding) if sliding else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )
        mc.validate()
        return mc

    def validate(self) -> None:
        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                  "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, f) <= 0:
                raise ConfigError(f"config.json: {f} must be > 0, got {getattr(self, f)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"config.json: num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        rs = self.rope_scaling
        if rs is not None:
            kind = rs.get("rope_type", rs.get("type"))
            if kind not in ("llama3", "linear", "default", None):
                raise ConfigError(f"config.json: rope_scaling type {kind!r} is not supported")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


DTYPES = ("auto", "float32", "bfloat16", "float16")
TP_BACKENDS = ("auto", "shm", "gloo", "nccl")
# engine.kernels.KERNEL_ISAS (a test holds them equal; config imports no torch)
KERNEL_ISAS = ("auto", "avx512bf16", "avx2", "none")


@dataclass
class EngineConfig:
    """Knobs of one engine instance (one stage replica or the offline LLM)."""

    dtype: str = "auto"
    device: str = "cpu"
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: derive from kv_cache_memory_gb
    kv_cache_memory_gb: float = 1.0
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    seed: int = 0
    enforce_eager: bool = False  # CUDA: never replay captured decode graphs (engine/cuda_graph.py)
    kv_cache_prefault: bool = False  # CPU: write every page of the KV cache at start (kv_cache.allocate_kv_cache)
    # tensor parallelism (engine/parallel): ranks, the all-reduce between them ("shm": shared
    # memory on one host, "gloo": torch.distributed over TCP, both CPU; "nccl": torch.distributed
    # on CUDA; "auto": shm on CPU, nccl on CUDA), and how long a collective may wait.
    # kv_cache_memory_gb / num_kv_blocks are per rank (each rank's cache holds only its KV heads).
    tensor_parallel_size: int = 1
    tp_backend: str = "auto"
    tp_timeout_s: float = 60.0
    # CPU bf16: which native kernel build runs (engine/kernels.py): "auto", the best this
    # CPU runs; "avx512bf16" or "avx2" (an error where the CPU lacks it); "none", torch's ops
    kernel_isa: str = "auto"

    @property
    def tp_comm_backend(self) -> str:
        """The collectives' backend once ``auto`` is resolved: shm on CPU, nccl on CUDA."""
        if self.tp_backend != "auto":
            return self.tp_backend
        return "nccl" if self.device.startswith("cuda") else "shm"

    def validate(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype: must be one of {DTYPES}, got {self.dtype!r}")
        if self.kernel_isa not in KERNEL_ISAS:
            raise ConfigError(f"kernel_isa: must be one of {KERNEL_ISAS}, got {self.kernel_isa!r}")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size: must be a positive power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise ConfigError(f"num_kv_blocks: must be > 0, got {self.num_kv_blocks}")
        if self.max_num_seqs <= 0:
            raise ConfigError(f"max_num_seqs: must be > 0, got {self.max_num_seqs}")
        tp = self.tensor_parallel_size
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ConfigError(f"tensor_parallel_size: must be an integer >= 1, got {tp!r}")
        if self.tp_backend not in TP_BACKENDS:
            raise ConfigError(f"tp_backend: must be one of {TP_BACKENDS}, got {self.tp_backend!r}")
        is_cuda = self.device.startswith("cuda")
        if self.tp_backend == "nccl" and not is_cuda:
            raise ConfigError(f"tp_backend: nccl needs device: cuda (device {self.device!r}; "
                              "on CPU use shm or gloo)")
        if tp > 1 and self.tp_backend in ("shm", "gloo") and is_cuda:
            raise ConfigError(f"tp_backend: {self.tp_backend} sums host memory and the device is "
                              f"{self.device!r}: use nccl (or auto)")
        if tp > 1 and is_cuda and self.device != "cuda":
            raise ConfigError(f"device: give 'cuda' at tensor_parallel_size {tp} (each rank takes its own "
                              f"GPU, engine.parallel.devices), got {self.device!r}")
        if not self.tp_timeout_s > 0:
            raise ConfigError(f"tp_timeout_s: must be > 0, got {self.tp_timeout_s}")
        if self.max_num_batched_tokens < self.block_size:
            raise ConfigError(
                f"max_num_batched_tokens: must be >= block_size ({self.block_size}), "
                f"got {self.max_num_batched_tokens}"
            )
