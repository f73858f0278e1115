"""Megatron-style tensor parallelism as a plan per weight, applied from outside the model.

`ShardLayout` says what one rank of a tensor-parallel group holds: its
attention heads, its KV heads, its MLP columns and its vocabulary range.
`weight_shards` maps every checkpoint tensor to how that rank cuts it:

    q|k|v, gate|up          column-parallel: rows of the [out, in] weight (and bias) split
    o_proj, down_proj       row-parallel: columns split; the model all-reduces the output
    embed_tokens, lm_head   vocab-parallel: rows split (padded to tp * ceil(vocab / tp))
    norms, q/k norm         replicated

KV heads are split across ranks, or replicated when tp > num_kv_heads (each
rank then holds the one KV head its query heads read). `load_shard` reads a
rank's pieces straight from the safetensors files (``get_slice``), so no rank
ever holds the full checkpoint.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import ConfigError, ModelConfig


def check_tensor_parallel(cfg: ModelConfig, tp: int) -> None:
    """Raise ConfigError naming ``tensor_parallel_size`` when `cfg` cannot be split `tp` ways."""
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ConfigError(f"tensor_parallel_size: must be an integer >= 1, got {tp!r}")
    if cfg.num_heads % tp:
        raise ConfigError(
            f"tensor_parallel_size: {tp} does not divide the model's num_attention_heads ({cfg.num_heads})")
    if cfg.num_kv_heads % tp and tp % cfg.num_kv_heads:
        raise ConfigError(
            f"tensor_parallel_size: {tp} must divide num_key_value_heads ({cfg.num_kv_heads}) "
            f"or be a multiple of it (then each KV head is replicated)")
    if cfg.intermediate_size % tp:
        raise ConfigError(
            f"tensor_parallel_size: {tp} does not divide the model's intermediate_size ({cfg.intermediate_size})")


def kv_heads_of(num_kv_heads: int, rank: int, size: int) -> tuple[int, int]:
    """(first global KV head, count) that rank `rank` of `size` holds: a split when size divides
    num_kv_heads; else (size a multiple of it) one replicated head, ranks
    [kv * size/nkv, (kv+1) * size/nkv) sharing head kv. The one rule; the KV transfer reads it too."""
    if size <= num_kv_heads:
        return rank * (num_kv_heads // size), num_kv_heads // size
    return rank // (size // num_kv_heads), 1


@dataclass(frozen=True)
class ShardLayout:
    """What rank `rank` of `size` holds (the whole model at size 1)."""

    rank: int
    size: int
    num_heads: int  # query heads on this rank
    num_kv_heads: int  # KV heads on this rank (1 when replicated)
    head_start: int  # first query head
    kv_head_start: int  # first KV head
    intermediate_size: int  # MLP columns on this rank
    vocab_start: int  # [vocab_start, vocab_start + vocab_shard) of the padded vocabulary
    vocab_shard: int  # rows of the embedding / LM head held (the last rank's may be padding)
    vocab_size: int  # the model's real vocabulary

    @classmethod
    def for_rank(cls, cfg: ModelConfig, rank: int, size: int) -> ShardLayout:
        check_tensor_parallel(cfg, size)
        nh = cfg.num_heads // size
        kv0, nkv = kv_heads_of(cfg.num_kv_heads, rank, size)
        vs = -(-cfg.vocab_size // size)
        return cls(rank, size, nh, nkv, rank * nh, kv0, cfg.intermediate_size // size,
                   rank * vs, vs, cfg.vocab_size)

    @property
    def is_sharded(self) -> bool:
        return self.size > 1

    @property
    def kv_head_range(self) -> tuple[int, int]:
        """The global KV heads [start, stop) this rank's cache holds (what a KV transfer moves)."""
        return self.kv_head_start, self.kv_head_start + self.num_kv_heads


@dataclass(frozen=True)
class WeightShard:
    """One rank's piece of a checkpoint tensor: [start, stop) along ``dim``, then zeros up to
    ``pad_to`` rows (the vocabulary padding). dim None: the whole tensor (replicated)."""

    dim: int | None
    start: int = 0
    stop: int = 0
    pad_to: int | None = None


def weight_shards(cfg: ModelConfig, layout: ShardLayout) -> dict[str, WeightShard]:
    """The plan: every tensor the model takes, and how `layout`'s rank cuts it."""
    hd = cfg.head_dim
    q = (layout.head_start * hd, (layout.head_start + layout.num_heads) * hd)
    kv = (layout.kv_head_start * hd, (layout.kv_head_start + layout.num_kv_heads) * hd)
    mlp = (layout.rank * layout.intermediate_size, (layout.rank + 1) * layout.intermediate_size)
    v0 = layout.vocab_start
    vocab = WeightShard(0, min(v0, cfg.vocab_size), min(v0 + layout.vocab_shard, cfg.vocab_size),
                        pad_to=layout.vocab_shard)
    whole = WeightShard(None)
    plan = {"model.embed_tokens.weight": vocab, "lm_head.weight": vocab, "model.norm.weight": whole}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        plan.update({
            p + "input_layernorm.weight": whole,
            p + "post_attention_layernorm.weight": whole,
            p + "self_attn.q_proj.weight": WeightShard(0, *q),
            p + "self_attn.k_proj.weight": WeightShard(0, *kv),
            p + "self_attn.v_proj.weight": WeightShard(0, *kv),
            p + "self_attn.o_proj.weight": WeightShard(1, *q),
            p + "mlp.gate_proj.weight": WeightShard(0, *mlp),
            p + "mlp.up_proj.weight": WeightShard(0, *mlp),
            p + "mlp.down_proj.weight": WeightShard(1, *mlp),
        })
        if cfg.attention_bias:
            plan.update({p + "self_attn.q_proj.bias": WeightShard(0, *q),
                         p + "self_attn.k_proj.bias": WeightShard(0, *kv),
                         p + "self_attn.v_proj.bias": WeightShard(0, *kv)})
        if cfg.qk_norm:
            plan.update({p + "self_attn.q_norm.weight": whole, p + "self_attn.k_norm.weight": whole})
    return plan


def _pad(t: torch.Tensor, shard: WeightShard) -> torch.Tensor:
    if shard.pad_to is None or t.shape[shard.dim] == shard.pad_to:
        return t
    shape = list(t.shape)
    shape[shard.dim] = shard.pad_to - t.shape[shard.dim]
    return torch.cat([t, t.new_zeros(shape)], dim=shard.dim)


def _read_slice(f, name: str, shard: WeightShard, dtype: torch.dtype) -> torch.Tensor:
    if shard.dim is None:
        return f.get_tensor(name).to(dtype)
    rows = slice(shard.start, shard.stop)
    t = f.get_slice(name)[rows] if shard.dim == 0 else f.get_slice(name)[:, rows]
    return _pad(t.to(dtype).contiguous(), shard)


def load_shard(folder: str | Path, layout: ShardLayout, dtype: torch.dtype = torch.float32
               ) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """`engine.weights.load_checkpoint` for one rank: the config, and this rank's piece of
    every tensor (shapes checked against the full shapes first), read by slicing the
    safetensors files, so the rank never holds a full tensor it does not keep."""
    from safetensors import SafetensorError, safe_open

    from engine.weights import CheckpointError, _weight_files, expected_shapes, read_config

    folder = Path(folder)
    cfg = read_config(folder)
    plan = weight_shards(cfg, layout)
    shapes = expected_shapes(cfg)
    out: dict[str, torch.Tensor] = {}
    for path in _weight_files(folder):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    if name not in plan:
                        continue
                    got = tuple(f.get_slice(name).get_shape())
                    if got != shapes[name]:
                        raise CheckpointError(f"{folder}: tensor {name!r} has shape {list(got)}, "
                                              f"expected {list(shapes[name])} from config.json")
                    out[name] = _read_slice(f, name, plan[name], dtype)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise CheckpointError(f"{path}: corrupt or truncated safetensors file ({e})") from e
    if "lm_head.weight" not in out and not cfg.tie_word_embeddings:
        raise CheckpointError(f"{folder}: tensor 'lm_head.weight' is missing and config.json does not set "
                              "tie_word_embeddings")
    missing = [n for n in plan if n not in out and n != "lm_head.weight"]
    if missing:
        raise CheckpointError(f"{folder}: tensor {missing[0]!r} is missing")
    return cfg, out
