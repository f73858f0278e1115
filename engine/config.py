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
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "OlmoeForCausalLM": "olmoe",
}
MODEL_TYPES = {"llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe"}


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
    # OLMoE: the q and k norms span the full projected width (every head's q, every KV head's k),
    # applied before the head split; under tensor parallelism their mean square sums all ranks
    qk_norm_full_width: bool = False
    clip_qkv: float | None = None  # OLMoE: q, k and v clamped to [-clip_qkv, clip_qkv] after the norms
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # mixture of experts (engine/moe.py); num_experts 0: a dense model. The layers in
    # moe_layers route each token to num_experts_per_tok of num_experts MLPs of
    # moe_intermediate_size columns (plus, for Qwen2-MoE, a shared expert behind a sigmoid
    # gate); the others keep the dense MLP of intermediate_size.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalize the top-k routing weights to sum to 1
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    moe_layers: tuple[int, ...] = ()

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0 and bool(self.moe_layers)

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
        sliding = (cfg.get("sliding_window") if cfg.get("use_sliding_window", arch in ("mistral", "mixtral"))
                   else None)
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
            attention_bias=bool(cfg.get("qkv_bias", True) if arch == "qwen2_moe"
                                else cfg.get("attention_bias", arch == "qwen2")),
            qk_norm=arch in ("qwen3", "qwen3_moe", "olmoe"),
            qk_norm_full_width=arch == "olmoe",
            clip_qkv=float(cfg["clip_qkv"]) if arch == "olmoe" and cfg.get("clip_qkv") is not None else None,
            sliding_window=int(sliding) if sliding else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            **_moe_fields(arch, cfg),
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
        if self.num_experts:
            if self.num_experts_per_tok < 1:
                raise ConfigError(f"config.json: num_experts_per_tok must be >= 1, got {self.num_experts_per_tok}")
            if self.num_experts_per_tok > self.num_experts:
                raise ConfigError(
                    f"config.json: num_experts_per_tok ({self.num_experts_per_tok}) must be <= the number of "
                    f"experts ({self.num_experts})")
            if self.moe_intermediate_size <= 0:
                raise ConfigError(
                    f"config.json: the experts' intermediate size must be > 0, got {self.moe_intermediate_size}")
            bad = [i for i in self.moe_layers if not 0 <= i < self.num_layers]
            if bad:
                raise ConfigError(f"config.json: MoE layer {bad[0]} is outside the {self.num_layers} layers")
        if self.clip_qkv is not None and not self.clip_qkv > 0:
            raise ConfigError(f"config.json: clip_qkv must be > 0 (or null), got {self.clip_qkv}")
        rs = self.rope_scaling
        if rs is not None:
            kind = rs.get("rope_type", rs.get("type"))
            if kind not in ("llama3", "linear", "default", None):
                raise ConfigError(f"config.json: rope_scaling type {kind!r} is not supported")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _moe_fields(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """The mixture-of-experts fields of ModelConfig from an HF config (none for a dense family)."""
    if arch in ("mixtral", "olmoe"):
        # every layer sparse, the experts' size is intermediate_size; Mixtral renormalizes the
        # top-k weights, OLMoE where norm_topk_prob says (it is false in the released models)
        n = int(cfg.get("num_local_experts", cfg.get("num_experts", 8)))
        return dict(num_experts=n, num_experts_per_tok=int(cfg.get("num_experts_per_tok", 2)),
                    moe_intermediate_size=int(cfg.get("intermediate_size", 0)),
                    norm_topk_prob=arch == "mixtral" or bool(cfg.get("norm_topk_prob", False)),
                    moe_layers=tuple(range(int(cfg.get("num_hidden_layers", 0)))) if n else ())
    if arch in ("qwen2_moe", "qwen3_moe"):
        # layer i is sparse unless listed in mlp_only_layers, where (i + 1) % decoder_sparse_step == 0
        n = int(cfg.get("num_experts", cfg.get("num_local_experts", 0)) or 0)  # transformers 5 writes the latter
        step = int(cfg.get("decoder_sparse_step", 1) or 1)
        dense = set(cfg.get("mlp_only_layers") or [])
        layers = tuple(i for i in range(int(cfg.get("num_hidden_layers", 0)))
                       if n > 0 and i not in dense and (i + 1) % step == 0)
        return dict(num_experts=n, num_experts_per_tok=int(cfg.get("num_experts_per_tok", 0)),
                    moe_intermediate_size=int(cfg.get("moe_intermediate_size", 0)),
                    norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                    shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size", 0))
                    if arch == "qwen2_moe" else 0,
                    moe_layers=layers)
    return {}


DTYPES = ("auto", "float32", "bfloat16", "float16")
TP_BACKENDS = ("auto", "shm", "gloo", "nccl")
# engine.kernels.KERNEL_ISAS (a test holds them equal; config imports no torch)
KERNEL_ISAS = ("auto", "avx512bf16", "avx512", "avx2", "none")
# engine.quant.QUANTIZATIONS (a test holds them equal)
QUANTIZATIONS = ("none", "int8", "gguf")
EXPERT_PLACEMENTS = ("contiguous", "round_robin")
MOE_DISPATCHES = ("allreduce", "alltoall")


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
    # pipeline parallelism: the layers split into this many contiguous ranges, one per pipeline
    # stage of ranks (each stage tensor_parallel_size ranks); even by default, or explicit layer
    # counts (`pipeline_layer_split`, summing to the model's layers: engine.parallel.sharding.pipeline_layers).
    # A replica has pipeline_parallel_size x tensor_parallel_size ranks, rank = pp_rank * tp + tp_rank.
    pipeline_parallel_size: int = 1
    pipeline_layer_split: tuple[int, ...] | None = None
    tp_backend: str = "auto"
    tp_timeout_s: float = 60.0
    # CPU bf16: which native kernel build runs (engine/kernels.py): "auto", the best this
    # CPU runs; "avx512bf16", "avx512" or "avx2" (an error where the CPU lacks it); "none", torch's ops
    kernel_isa: str = "auto"
    # matmul weights kept quantized (engine/quant.py), computed on with fp32 activations by the
    # native CPU kernels: "none"; "int8", per-row int8 made at load from any checkpoint; "gguf",
    # a GGUF file's own blocks (Q8_0, Q5_0, Q5_1, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K; engine/quant.py)
    quantization: str = "none"
    # mixture of experts at tensor_parallel_size > 1 (engine/parallel/moe.py): split the experts
    # across the ranks (attention stays tensor-parallel) instead of splitting every expert's
    # columns; which rank holds which expert ("contiguous" ranges or "round_robin"); and how the
    # tokens meet their experts ("allreduce": every rank runs its experts on all tokens, the
    # MLP's all-reduce combines; "alltoall": each rank's slice of the tokens sent to their experts'
    # ranks and back, then all-gathered; expert parallelism only, on every tp_backend).
    enable_expert_parallel: bool = False
    expert_placement: str = "contiguous"
    moe_dispatch: str = "allreduce"

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
        if self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"quantization: must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        if self.quantization != "none":
            q = f"quantization: {self.quantization!r}"
            if not self.device.startswith("cpu"):
                raise ConfigError(f"{q} runs on CPU only (device {self.device!r})")
            if self.dtype not in ("auto", "float32"):
                raise ConfigError(f"{q} computes with fp32 activations on the quantized weights; dtype must be "
                                  f"'auto' or 'float32', got {self.dtype!r}")
            if self.kernel_isa == "none":
                raise ConfigError(f"{q} needs a native CPU kernel path; kernel_isa 'none' runs torch's ops")
            if self.tensor_parallel_size != 1:
                raise ConfigError(f"{q} is not supported with tensor_parallel_size {self.tensor_parallel_size} "
                                  "yet (the shards of a quantized weight are not cut); use 1")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size: must be a positive power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise ConfigError(f"num_kv_blocks: must be > 0, got {self.num_kv_blocks}")
        if self.max_num_seqs <= 0:
            raise ConfigError(f"max_num_seqs: must be > 0, got {self.max_num_seqs}")
        tp = self.tensor_parallel_size
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ConfigError(f"tensor_parallel_size: must be an integer >= 1, got {tp!r}")
        pp = self.pipeline_parallel_size
        if not isinstance(pp, int) or isinstance(pp, bool) or pp < 1:
            raise ConfigError(f"pipeline_parallel_size: must be an integer >= 1, got {pp!r}")
        split = self.pipeline_layer_split
        if split is not None:
            if (not isinstance(split, (list, tuple)) or
                    any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in split)):
                raise ConfigError(f"pipeline_layer_split: must be a list of layer counts >= 1, got {split!r}")
            if len(split) != pp:
                raise ConfigError(f"pipeline_layer_split: {len(split)} counts for pipeline_parallel_size {pp}; "
                                  "give one per pipeline stage")
        if pp > 1 and self.quantization != "none":
            raise ConfigError(f"quantization: {self.quantization!r} is not supported with pipeline_parallel_size "
                              f"{pp} yet; use 'none'")
        if self.tp_backend not in TP_BACKENDS:
            raise ConfigError(f"tp_backend: must be one of {TP_BACKENDS}, got {self.tp_backend!r}")
        if self.expert_placement not in EXPERT_PLACEMENTS:
            raise ConfigError(f"expert_placement: must be one of {EXPERT_PLACEMENTS}, got {self.expert_placement!r}")
        if self.moe_dispatch not in MOE_DISPATCHES:
            raise ConfigError(f"moe_dispatch: must be one of {MOE_DISPATCHES}, got {self.moe_dispatch!r}")
        if self.moe_dispatch == "alltoall" and (tp == 1 or not self.enable_expert_parallel):
            raise ConfigError("moe_dispatch: 'alltoall' sends each token to the rank holding its experts, so it "
                              "needs enable_expert_parallel at tensor_parallel_size > 1 (got tensor_parallel_size "
                              f"{tp}, enable_expert_parallel {self.enable_expert_parallel}); use 'allreduce'")
        is_cuda = self.device.startswith("cuda")
        if self.tp_backend == "nccl" and not is_cuda:
            raise ConfigError(f"tp_backend: nccl needs device: cuda (device {self.device!r}; "
                              "on CPU use shm or gloo)")
        if tp > 1 and self.tp_backend in ("shm", "gloo") and is_cuda:
            raise ConfigError(f"tp_backend: {self.tp_backend} sums host memory and the device is "
                              f"{self.device!r}: use nccl (or auto)")
        if pp > 1 and is_cuda and self.tp_backend in ("shm", "gloo"):
            # (the hand-offs go rank to rank over NCCL on CUDA, engine.parallel.pipe.DistLinks)
            raise ConfigError(f"tp_backend: {self.tp_backend} hands the stages' activations on through host "
                              f"memory and the device is {self.device!r}: use nccl (or auto) at "
                              f"pipeline_parallel_size {pp}")
        if pp > 1 and self.device not in ("cpu", "cuda"):
            raise ConfigError(f"device: give 'cpu' or 'cuda' at pipeline_parallel_size {pp} (on CUDA each rank "
                              f"takes its own GPU, engine.parallel.devices), got {self.device!r}")
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
