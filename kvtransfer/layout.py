"""A replica's KV layout: which global layers and KV heads each rank's paged cache holds.

Every rank's cache has the engine's heads-inner layout (engine/kv_cache.py),
``kv[layer]: [num_blocks, 2, block_size, heads_of(rank), head_dim]``, so a
head range of a block is a strided view (``2 * block_size`` runs of
``heads * head_dim`` elements), and a rank's whole block is one slab. The
split is engine.parallel.sharding's rule (``kv_heads_of``): split when tp
divides num_kv_heads, one replicated head per rank when tp is a multiple.

Pipeline parallelism: a replica of ``pp_size x tp_size`` ranks, rank = pp_rank
* tp + tp_rank, where rank r holds the global layers ``rank_layers[r]`` (by
default engine.parallel.sharding's ``pipeline_layers``, stage ``r // tp``) and
the KV heads of tp rank ``r % tp``. Its cache list is LOCAL: index i is global
layer ``rank_layers[r][i]``. Every pairing of a prefill buffer with a decode
buffer goes by global layer id (``global_layers``), never by list position.

The layout travels in the handshake fingerprint (``fingerprint_fields``):
the global fields are compared field by field as before; ``tp_size``,
``kv_heads`` (per tp rank ``start-stop``), ``pp_size`` and ``kv_layers`` (per
rank ``start-stop``) may differ between the peers, and the plan between them
(reshard.py) must cover every decode rank exactly once. A peer that sends no
``pp_size`` / ``kv_layers`` (older kvrelay) is one pipeline stage: every rank
all layers.

Decode-side pipeline parallelism is refused (``check_decode``, DECODE_PP_REASON).
"""
from __future__ import annotations

from dataclasses import dataclass

from kvtransfer.reshard import TransferPlan, check_plan, layer_span, plan_transfer
from kvtransfer.types import PlanError

LAYOUT_FIELDS = ("tp_size", "kv_heads", "pp_size", "kv_layers")  # may differ between a sender and a receiver
DECODE_PP_REASON = (
    "a decode replica runs one pipeline stage (pipeline_parallel_size 1): a decode step is one token per "
    "sequence, so under pipeline parallelism every token would cross every stage boundary in turn and the "
    "stages would mostly wait on each other, while the KV a decode rank needs is all of its layers; split a "
    "decode replica with tensor_parallel_size instead (the KV hand-off goes to the ranks of that one stage)")
_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int  # the model's, all ranks together
    head_dim: int
    block_size: int
    dtype: str  # "float32" | "bfloat16" | "float16"
    tp_size: int = 1
    # per rank, the global KV heads it holds; None: engine.parallel.sharding's rule. Given only for what a
    # peer advertised (from_fingerprint), or a test's deliberately wrong layout.
    rank_heads: tuple[range, ...] | None = None
    pp_size: int = 1
    # per rank (pp_size * tp_size of them), the global layers it holds; None: pipeline_layers' even split,
    # or `layer_split`'s counts. Given as-is only for what a peer advertised, or a test's wrong layout.
    rank_layers: tuple[range, ...] | None = None
    layer_split: tuple[int, ...] | None = None  # per pipeline stage, its number of layers (pipeline_layer_split)

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size", "tp_size", "pp_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"KVLayout.{name}: must be an int >= 1, got {value!r}")
        if self.dtype not in _ITEMSIZE:
            raise ValueError(f"KVLayout.dtype: must be one of {tuple(_ITEMSIZE)}, got {self.dtype!r}")
        if self.rank_heads is None:
            if self.num_kv_heads % self.tp_size and self.tp_size % self.num_kv_heads:
                raise ValueError(f"KVLayout.tp_size: {self.tp_size} must divide num_kv_heads ({self.num_kv_heads}) "
                                 "or be a multiple of it")
            from engine.parallel.sharding import kv_heads_of

            heads = tuple(range(s, s + n) for s, n in
                          (kv_heads_of(self.num_kv_heads, r, self.tp_size) for r in range(self.tp_size)))
            object.__setattr__(self, "rank_heads", heads)
        elif len(self.rank_heads) != self.tp_size:
            raise ValueError(f"KVLayout.rank_heads: {len(self.rank_heads)} ranks for tp_size {self.tp_size}")
        if self.rank_layers is None:
            from engine.config import ConfigError
            from engine.parallel.sharding import pipeline_layers

            try:
                stages = pipeline_layers(self.num_layers, self.pp_size, self.layer_split)
            except ConfigError as e:
                raise ValueError(f"KVLayout.{e}") from None
            object.__setattr__(self, "rank_layers", tuple(stages[r // self.tp_size] for r in range(self.num_ranks)))
        elif len(self.rank_layers) != self.num_ranks:
            raise ValueError(f"KVLayout.rank_layers: {len(self.rank_layers)} ranks for pp_size {self.pp_size} x "
                             f"tp_size {self.tp_size}")
        for r, layers in enumerate(self.rank_layers):
            if not isinstance(layers, range) or layers.step != 1 or layers.start < 0:
                raise ValueError(f"KVLayout.rank_layers: rank {r} holds {layers!r}, not a run of layers")

    @property
    def num_ranks(self) -> int:
        return self.pp_size * self.tp_size

    @property
    def shape_name(self) -> str:
        """``tp_size 2``, or under pipeline parallelism ``pp_size 2 x tp_size 2``: for messages."""
        return (f"pp_size {self.pp_size} x " if self.pp_size > 1 else "") + f"tp_size {self.tp_size}"

    def heads_of(self, rank: int) -> range:
        """The global KV heads rank `rank`'s cache holds, in its cache's order (those of tp rank rank % tp)."""
        return self.rank_heads[rank % self.tp_size]

    def layers_of(self, rank: int) -> range:
        """The global layers rank `rank`'s cache holds: its local layer i is global layer layers_of(rank)[i]."""
        return self.rank_layers[rank]

    @property
    def heads_by_rank(self) -> tuple[range, ...]:
        """Per rank (all pp_size * tp_size), its global KV heads."""
        return tuple(self.heads_of(r) for r in range(self.num_ranks))

    def global_layers(self, rank_caches: list[list]) -> list[list]:
        """rank -> GLOBAL layer id -> that rank's buffer of it (None where the rank does not hold the layer),
        from rank -> local layer lists: what a transfer indexes by a chunk's (global) layer."""
        out = []
        for rank, layers in enumerate(rank_caches):
            by_global = [None] * self.num_layers
            for i, layer in enumerate(self.layers_of(rank)):
                by_global[layer] = layers[i]
            out.append(by_global)
        return out

    def check_decode(self) -> None:
        """ValueError unless this layout can receive a hand-off: one pipeline stage holding every layer."""
        if self.pp_size != 1:
            raise ValueError(f"decode KV layout: pp_size {self.pp_size} refused: {DECODE_PP_REASON}")

    @property
    def head_bytes(self) -> int:
        """One KV head of one block of one layer (keys and values)."""
        return 2 * self.block_size * self.head_dim * _ITEMSIZE[self.dtype]

    def slab_bytes(self, rank: int) -> int:
        """One block of one layer of rank `rank`'s cache."""
        return len(self.heads_of(rank)) * self.head_bytes

    def fingerprint_fields(self) -> dict[str, str]:
        return {"num_layers": str(self.num_layers), "num_kv_heads": str(self.num_kv_heads),
                "head_dim": str(self.head_dim), "block_size": str(self.block_size), "dtype": self.dtype,
                "tp_size": str(self.tp_size),
                "kv_heads": ",".join(f"{h.start}-{h.stop}" for h in self.rank_heads),
                "pp_size": str(self.pp_size),
                "kv_layers": ",".join(f"{l.start}-{l.stop}" for l in self.rank_layers)}

    @classmethod
    def from_fingerprint(cls, fp: dict[str, str]) -> KVLayout:
        """The layout a peer advertised (its ``kv_heads`` and ``kv_layers`` as given; without them, the sharding
        rule's heads and, for a peer older than pipeline parallelism, pp_size 1: every rank all layers)."""
        try:
            num = {k: int(fp[k]) for k in ("num_layers", "num_kv_heads", "head_dim", "block_size")}
            tp, pp = int(fp.get("tp_size", "1")), int(fp.get("pp_size", "1"))
            heads = _ranges(fp["kv_heads"]) if "kv_heads" in fp else None
            layers = _ranges(fp["kv_layers"]) if "kv_layers" in fp else None
            return cls(**num, dtype=fp["dtype"], tp_size=tp, rank_heads=heads, pp_size=pp, rank_layers=layers)
        except KeyError as e:
            raise ValueError(f"fingerprint has no {e.args[0]!r}: no KV layout") from None
        except ValueError as e:
            raise ValueError(f"fingerprint's KV layout is malformed: {e}") from None

    def plan_to(self, dst: KVLayout) -> TransferPlan:
        """The checked plan from this (prefill) layout into `dst` (decode); PlanError names what is wrong: a layer
        or head no prefill rank holds, a layer two hold, or a decode layout of more than one pipeline stage."""
        if dst.pp_size != 1:
            raise PlanError(f"decode layout of pp_size {dst.pp_size} refused: {DECODE_PP_REASON}")
        plan = plan_transfer(self.num_layers, self.heads_by_rank, dst.rank_heads, self.rank_layers, self.tp_size)
        check_plan(plan)
        return plan

    def check_caches(self, rank_caches) -> None:
        """ValueError unless `rank_caches` (rank -> LOCAL layer -> tensor) has this layout's ranks, each rank's
        number of layers, shapes and dtype."""
        if len(rank_caches) != self.num_ranks:
            raise ValueError(f"kv_caches: {len(rank_caches)} ranks, the layout has {self.shape_name}")
        for rank, layers in enumerate(rank_caches):
            held = self.layers_of(rank)
            if len(layers) != len(held):
                raise ValueError(f"kv_caches: rank {rank} has {len(layers)} layers, expected {len(held)}"
                                 + (f" ({layer_span(held)})" if len(held) != self.num_layers else ""))
            want = (2, self.block_size, len(self.heads_of(rank)), self.head_dim)
            for i, kv in enumerate(layers):
                if tuple(kv.shape[1:]) != want or kv.element_size() != _ITEMSIZE[self.dtype]:
                    raise ValueError(f"kv_caches: rank {rank} layer {held[i]} is {list(kv.shape)} {kv.dtype}, "
                                     f"expected [num_blocks, {', '.join(map(str, want))}] {self.dtype}")

    @classmethod
    def of_caches(cls, kv_caches, dtype: str | None = None) -> KVLayout:
        """The one-rank layout of a TP=1 cache (``layer -> [num_blocks, 2, block_size, heads, head_dim]``)."""
        from engine.kv_cache import dtype_name

        _, _, block_size, heads, head_dim = kv_caches[0].shape
        return cls(len(kv_caches), int(heads), int(head_dim), int(block_size), dtype or dtype_name(kv_caches[0].dtype))


def _ranges(text: str) -> tuple[range, ...]:
    """``"0-2,2-4"`` -> (range(0, 2), range(2, 4))."""
    return tuple(range(int(a), int(b)) for a, b in (p.split("-") for p in text.split(",")))


def with_layout(fingerprint: dict[str, str], layout: KVLayout) -> dict[str, str]:
    """`fingerprint` carrying `layout`: its global num_kv_heads, tp_size, per-rank heads, pp_size and per-rank
    layers.

    A field both name (layers, head size, block size, dtype) must agree: ValueError otherwise."""
    fields = layout.fingerprint_fields()
    for key in ("num_layers", "head_dim", "block_size", "dtype"):
        if key in fingerprint and fingerprint[key] != fields[key]:
            raise ValueError(f"fingerprint: {key} is {fingerprint[key]!r}, the KV layout has {fields[key]!r}")
    return {**fingerprint, **fields}


def normalize_caches(kv_caches) -> list[list]:
    """rank -> layer -> tensor; a plain per-layer list (TP=1) is the one-rank case."""
    if not kv_caches:
        raise ValueError("kv_caches: need at least one rank and one layer")
    if isinstance(kv_caches[0], (list, tuple)):
        return [list(layers) for layers in kv_caches]
    return [list(kv_caches)]


def engine_kv(core) -> tuple[KVLayout, list[list]]:
    """An EngineCore's layout and every rank's cache (rank 0's own; the others mapped from their shared
    memory by its TPGroup): what a stage hands its KVSender / KVReceiver.

    Under pipeline parallelism the group's ``rank_layers()`` (per rank, its global layers) gives each rank's
    layers and ``rank_kv_caches()`` their LOCAL lists."""
    from engine.kv_cache import dtype_name

    config, group = core.config, core.tp_group
    rank_layers = getattr(group, "rank_layers", None)
    layout = KVLayout(core.model_config.num_layers, core.model_config.num_kv_heads, core.kv_spec.head_dim,
                      core.kv_spec.block_size, dtype_name(core.kv_caches[0].dtype), config.tensor_parallel_size,
                      pp_size=getattr(config, "pipeline_parallel_size", 1),
                      layer_split=getattr(config, "pipeline_layer_split", None),
                      rank_layers=tuple(rank_layers()) if rank_layers is not None else None)
    caches = group.rank_kv_caches() if group is not None else [core.kv_caches]
    return layout, caches
