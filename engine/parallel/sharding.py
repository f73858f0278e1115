"""Megatron-style tensor parallelism as a plan per weight, applied from outside the model.

`ShardLayout` says what one rank of a tensor-parallel group holds: its
attention heads, its KV heads, its MLP columns and its vocabulary range.
`weight_shards` maps every checkpoint tensor to how that rank cuts it:

    q|k|v, gate|up          column-parallel: rows of the [out, in] weight (and bias) split
    o_proj, down_proj       row-parallel: columns split; the model all-reduces the output
    embed_tokens, lm_head   vocab-parallel: rows split (padded to tp * ceil(vocab / tp))
    norms, q/k norm         replicated; OLMoE's full-width q/k norms cut like q and k
    MoE router              replicated (every rank routes every token)
    MoE experts             without expert parallelism: each expert's gate|up column- and
                            down row-parallel, like the dense MLP; with it (`expert_parallel`):
                            whole experts, split across the ranks (`expert_placement`)
    shared expert (Qwen2)   column/row-parallel like the dense MLP; its sigmoid gate replicated;
                            whole on every rank under the ``alltoall`` dispatch (each rank runs
                            it on its own slice of the tokens: engine/parallel/moe.py)

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
from engine.moe import checkpoint_sources
from engine.moe import layer_shapes as moe_layer_shapes


def check_tensor_parallel(cfg: ModelConfig, tp: int, expert_parallel: bool = False) -> None:
    """Raise ConfigError naming ``tensor_parallel_size`` when `cfg` cannot be split `tp` ways
    (with `expert_parallel`, the experts whole across the ranks)."""
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ConfigError(f"tensor_parallel_size: must be an integer >= 1, got {tp!r}")
    if cfg.num_heads % tp:
        raise ConfigError(
            f"tensor_parallel_size: {tp} does not divide the model's num_attention_heads ({cfg.num_heads})")
    if cfg.num_kv_heads % tp and tp % cfg.num_kv_heads:
        raise ConfigError(
            f"tensor_parallel_size: {tp} must divide num_key_value_heads ({cfg.num_kv_heads}) "
            f"or be a multiple of it (then each KV head is replicated)")
    has_dense_mlp = len(cfg.moe_layers) < cfg.num_layers
    if has_dense_mlp and cfg.intermediate_size % tp:
        raise ConfigError(
            f"tensor_parallel_size: {tp} does not divide the model's intermediate_size ({cfg.intermediate_size})")
    if not cfg.is_moe:
        return
    if cfg.shared_expert_intermediate_size % tp:
        raise ConfigError(f"tensor_parallel_size: {tp} does not divide the model's "
                          f"shared_expert_intermediate_size ({cfg.shared_expert_intermediate_size})")
    if expert_parallel and tp > cfg.num_experts:
        raise ConfigError(f"enable_expert_parallel: tensor_parallel_size {tp} exceeds the model's "
                          f"{cfg.num_experts} experts (a rank would hold none); use a smaller size or no "
                          "expert parallelism")
    if not expert_parallel and cfg.moe_intermediate_size % tp:
        raise ConfigError(
            f"tensor_parallel_size: {tp} does not divide the experts' intermediate size "
            f"({cfg.moe_intermediate_size}); use a size that does, or enable_expert_parallel")


def expert_ranks(num_experts: int, size: int, placement: str = "contiguous") -> list[tuple[int, ...]]:
    """The expert ids each of `size` ranks holds under expert parallelism, ascending.
    contiguous: ranges, the first num_experts % size ranks one expert more (uneven splits are
    fine: a rank with more experts just has more to run); round_robin: expert e on rank e % size."""
    if placement == "round_robin":
        return [tuple(range(r, num_experts, size)) for r in range(size)]
    if placement != "contiguous":
        raise ConfigError(f"expert_placement: must be 'contiguous' or 'round_robin', got {placement!r}")
    base, extra = divmod(num_experts, size)
    starts = [r * base + min(r, extra) for r in range(size + 1)]
    return [tuple(range(starts[r], starts[r + 1])) for r in range(size)]


def kv_heads_of(num_kv_heads: int, rank: int, size: int) -> tuple[int, int]:
    """(first global KV head, count) that rank `rank` of `size` holds: a split when size divides
    num_kv_heads; else (size a multiple of it) one replicated head, ranks
    [kv * size/nkv, (kv+1) * size/nkv) sharing head kv. The one rule; the KV transfer reads it too."""
    if size <= num_kv_heads:
        return rank * (num_kv_heads // size), num_kv_heads // size
    return rank // (size // num_kv_heads), 1


def pipeline_layers(num_layers: int, pp: int, split=None) -> tuple[range, ...]:
    """The global layers of each pipeline stage: contiguous ranges, ``split``'s counts in
    order, or as even as they go (the first ``num_layers % pp`` stages one layer more).
    ConfigError names ``pipeline_layer_split`` / ``pipeline_parallel_size`` where they do
    not fit the model."""
    if split is None:
        if pp > num_layers:
            raise ConfigError(f"pipeline_parallel_size: {pp} stages for a model of {num_layers} layers; "
                              "each stage needs at least one layer")
        base, extra = divmod(num_layers, pp)
        split = [base + (i < extra) for i in range(pp)]
    if len(split) != pp:
        raise ConfigError(f"pipeline_layer_split: {len(split)} counts for pipeline_parallel_size {pp}")
    if sum(split) != num_layers:
        raise ConfigError(f"pipeline_layer_split: {list(split)} sums to {sum(split)} layers; the model has "
                          f"{num_layers}")
    ranges, start = [], 0
    for n in split:
        ranges.append(range(start, start + n))
        start += n
    return tuple(ranges)


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
    experts: tuple[int, ...] = ()  # MoE: the expert ids this rank holds (all without expert parallelism)
    moe_intermediate_size: int = 0  # MoE: columns of each held expert on this rank
    shared_intermediate_size: int = 0  # Qwen2-MoE: columns of the shared expert on this rank
    expert_parallel: bool = False
    expert_owner: tuple[int, ...] = ()  # expert parallelism: the rank holding each expert
    is_shared_expert_whole: bool = False  # the shared expert replicated (the alltoall dispatch)
    # pipeline parallelism: this rank's stage and its global layers (all of them at pp 1); the
    # embedding lives on the first stage, the final norm and the LM head on the last
    layers: range | None = None
    pp_rank: int = 0
    pp_size: int = 1

    @classmethod
    def for_engine(cls, cfg: ModelConfig, rank: int, config) -> ShardLayout:
        """The layout of global rank `rank` (= pp_rank * tp + tp_rank) under an EngineConfig's
        parallelism settings."""
        tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
        pp_rank, tp_rank = divmod(rank, tp)
        layers = pipeline_layers(cfg.num_layers, pp, config.pipeline_layer_split)[pp_rank]
        return cls.for_rank(cfg, tp_rank, tp, config.enable_expert_parallel, config.expert_placement,
                            layers=layers, pp_rank=pp_rank, pp_size=pp, moe_dispatch=config.moe_dispatch)

    @classmethod
    def for_rank(cls, cfg: ModelConfig, rank: int, size: int, expert_parallel: bool = False,
                 expert_placement: str = "contiguous", layers: range | None = None, pp_rank: int = 0,
                 pp_size: int = 1, moe_dispatch: str = "allreduce") -> ShardLayout:
        """`rank` is the rank inside its tensor-parallel group (of `size`)."""
        check_tensor_parallel(cfg, size, expert_parallel)
        nh = cfg.num_heads // size
        kv0, nkv = kv_heads_of(cfg.num_kv_heads, rank, size)
        vs = -(-cfg.vocab_size // size)
        moe = {}
        if cfg.is_moe:
            ep = expert_parallel and size > 1
            placed = expert_ranks(cfg.num_experts, size, expert_placement) if ep else None
            whole = ep and moe_dispatch == "alltoall"
            moe = dict(experts=placed[rank] if ep else tuple(range(cfg.num_experts)),
                       moe_intermediate_size=cfg.moe_intermediate_size // (1 if ep else size),
                       shared_intermediate_size=cfg.shared_expert_intermediate_size // (1 if whole else size),
                       expert_parallel=ep, is_shared_expert_whole=whole,
                       expert_owner=tuple(r for e in range(cfg.num_experts) for r in range(size)
                                          if e in placed[r]) if ep else ())
        return cls(rank, size, nh, nkv, rank * nh, kv0, cfg.intermediate_size // size,
                   rank * vs, vs, cfg.vocab_size, **moe,
                   layers=layers if layers is not None else range(cfg.num_layers), pp_rank=pp_rank, pp_size=pp_size)

    @property
    def is_sharded(self) -> bool:
        """Tensor-parallel: heads, columns and vocabulary cut across ranks."""
        return self.size > 1

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

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
    plan = {}
    if layout.is_first_stage or (layout.is_last_stage and cfg.tie_word_embeddings):
        plan["model.embed_tokens.weight"] = vocab  # (the last stage's LM head, where tied)
    if layout.is_last_stage:
        plan.update({"lm_head.weight": vocab, "model.norm.weight": whole})
    layers = layout.layers if layout.layers is not None else range(cfg.num_layers)
    for i in layers:
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
        if cfg.qk_norm_full_width:  # (OLMoE) cut like the q and k projections' rows
            plan.update({p + "self_attn.q_norm.weight": WeightShard(0, *q),
                         p + "self_attn.k_norm.weight": WeightShard(0, *kv)})
        elif cfg.qk_norm:
            plan.update({p + "self_attn.q_norm.weight": whole, p + "self_attn.k_norm.weight": whole})
    for i in cfg.moe_layers:
        if i not in layers:
            continue
        p = f"model.layers.{i}."
        for name in ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"):
            del plan[p + name]
        cols = layout.rank * layout.moe_intermediate_size, (layout.rank + 1) * layout.moe_intermediate_size
        if layout.expert_parallel:
            cols = 0, layout.moe_intermediate_size
        shared = layout.rank * layout.shared_intermediate_size, (layout.rank + 1) * layout.shared_intermediate_size
        if layout.is_shared_expert_whole:
            shared = 0, layout.shared_intermediate_size
        for name in moe_layer_shapes(cfg, i, layout.experts):
            kind = name.rsplit(".", 2)[-2]  # gate | gate_proj | up_proj | down_proj | shared_expert_gate
            span = shared if ".shared_expert." in name else cols
            plan[name] = (whole if kind in ("gate", "shared_expert_gate")
                          else WeightShard(1 if kind == "down_proj" else 0, *span))
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


def _check_and_cut(folder, name: str, t: torch.Tensor, shape: tuple[int, ...], shard: WeightShard,
                   dtype: torch.dtype) -> torch.Tensor:
    from engine.weights import CheckpointError

    if tuple(t.shape) != shape:
        raise CheckpointError(f"{folder}: tensor {name!r} has shape {list(t.shape)}, expected {list(shape)} "
                              "from config.json")
    if shard.dim is not None:
        t = t.narrow(shard.dim, shard.start, shard.stop - shard.start)
    return t.to(dtype).contiguous()


def load_shard(folder: str | Path, layout: ShardLayout, dtype: torch.dtype = torch.float32
               ) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """`engine.weights.load_checkpoint` for one rank: the config, and this rank's piece of
    every tensor (shapes checked against the full shapes first), read by slicing the
    safetensors files, so the rank never holds a full tensor it does not keep."""
    from safetensors import SafetensorError, safe_open

    from engine.moe import LayoutError
    from engine.weights import CheckpointError, _weight_files, expected_shapes, read_config

    folder = Path(folder)
    cfg = read_config(folder)
    plan = weight_shards(cfg, layout)
    shapes = expected_shapes(cfg)
    out: dict[str, torch.Tensor] = {}
    for path in _weight_files(folder):
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    got = tuple(f.get_slice(key).get_shape())
                    for name, read in checkpoint_sources(cfg, key, got, f.get_slice):
                        if name not in plan:
                            continue
                        if name != key:  # an expert out of another layout: read whole, then cut
                            out[name] = _check_and_cut(folder, name, read(), shapes[name], plan[name], dtype)
                            continue
                        if got != shapes[name]:
                            raise CheckpointError(f"{folder}: tensor {name!r} has shape {list(got)}, "
                                                  f"expected {list(shapes[name])} from config.json")
                        out[name] = _read_slice(f, name, plan[name], dtype)
        except LayoutError as e:
            raise CheckpointError(f"{folder}: {e}") from e
        except (SafetensorError, OSError, RuntimeError) as e:
            raise CheckpointError(f"{path}: corrupt or truncated safetensors file ({e})") from e
    if layout.is_last_stage and "lm_head.weight" not in out and not cfg.tie_word_embeddings:
        raise CheckpointError(f"{folder}: tensor 'lm_head.weight' is missing and config.json does not set "
                              "tie_word_embeddings")
    missing = [n for n in plan if n not in out and n != "lm_head.weight"]
    if missing:
        raise CheckpointError(f"{folder}: tensor {missing[0]!r} is missing")
    return cfg, out
