"""The paged KV cache: its layout, its allocation, and its fingerprint.

Layout (the contract the transfer service relies on): one tensor per layer,

    kv[layer]: [num_blocks, 2, block_size, num_kv_heads, head_dim]

so block ``b`` of layer ``l`` is the contiguous slab ``kv[l][b]`` of
``2 * block_size * num_kv_heads * head_dim`` elements (keys first, then
values). A transfer moves whole slabs; it never reshapes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import ModelConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    for k, v in _DTYPES.items():
        if v == dtype:
            return k
    raise ValueError(f"unsupported dtype {dtype}")


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str  # "float32" | "bfloat16" | "float16"

    @classmethod
    def for_model(cls, model: ModelConfig, block_size: int, dtype: str,
                  num_kv_heads: int | None = None, num_layers: int | None = None) -> "KVCacheSpec":
        """``num_kv_heads``: the heads one tensor-parallel rank holds; ``num_layers``: the layers one
        pipeline stage holds (default: all of them)."""
        return cls(num_layers or model.num_layers, num_kv_heads or model.num_kv_heads, model.head_dim, block_size,
                   dtype)

    @property
    def block_shape(self) -> tuple[int, int, int, int]:
        return (2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def block_numel(self) -> int:
        return 2 * self.block_size * self.num_kv_heads * self.head_dim

    @property
    def bytes_per_block_per_layer(self) -> int:
        return self.block_numel * torch_dtype(self.dtype).itemsize

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block across all layers."""
        return self.bytes_per_block_per_layer * self.num_layers

    def num_blocks_for_memory(self, gigabytes: float) -> int:
        return max(1, int(gigabytes * (1 << 30)) // self.bytes_per_block)


def allocate_kv_cache(spec: KVCacheSpec, num_blocks: int, device: str | torch.device = "cpu",
                      prefault: bool = False) -> list[torch.Tensor]:
    """Zeroed per-layer KV tensors in the layout documented above (on a CPU,
    in huge pages where available: attention streams them like weights).

    A CPU cache is fresh anonymous memory: only pages written are backed, and
    the first write of each page faults (BENCHMARKS.md, "Measured design
    choices", has the cost). ``prefault``
    writes every page now, so that a cache the machine cannot hold fails here
    rather than under load, and no request pays those faults.
    """
    dt = torch_dtype(spec.dtype)
    if torch.device(device).type == "cpu":
        from engine.hugepages import zeros

        caches = zeros([(num_blocks, *spec.block_shape)] * spec.num_layers, dt)
        if caches is not None:
            if prefault:
                for layer in caches:
                    layer.zero_()
            return caches
    return [torch.zeros((num_blocks, *spec.block_shape), dtype=dt, device=device)
            for _ in range(spec.num_layers)]


def model_fingerprint(model: ModelConfig, spec: KVCacheSpec, tp_size: int = 1) -> dict[str, str]:
    """What two workers must agree on before KV blocks may move between them.

    Values are strings so the handshake can compare field by field and name
    the first field that differs. ``num_kv_heads`` is the model's (all ranks);
    the KV transfer adds each rank's heads (kvtransfer.layout.with_layout).

    The weights' format (EngineConfig.quantization) is deliberately not in it:
    replicas whose weights are stored differently may share a deployment (say
    a gguf prefill pool and an int8 decode pool) whenever what actually moves
    agrees, the KV dtype and layout checked here. A quantized replica computes
    with fp32 activations and holds an fp32 KV cache, so it pairs with fp32 or
    other quantized replicas and is refused by a bf16 one (field `dtype`). Its
    KV is that of the same model to quantization error: for gguf the function
    of the dequantized fp32 weights exactly (tests/engine/test_quant_model.py).
    """
    fp = {
        "architecture": model.architecture,
        "num_layers": str(model.num_layers),  # the model's (a pipeline rank's cache holds some of them)
        "num_kv_heads": str(model.num_kv_heads),
        "head_dim": str(spec.head_dim),
        "block_size": str(spec.block_size),
        "dtype": spec.dtype,
        "hidden_size": str(model.hidden_size),
        "vocab_size": str(model.vocab_size),
        "tp_size": str(tp_size),
    }
    return fp
