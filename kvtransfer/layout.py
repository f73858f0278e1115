"""A replica's KV layout: which global KV heads each tensor-parallel rank's paged cache holds.

Every rank's cache has the engine's heads-inner layout (engine/kv_cache.py),
``kv[layer]: [num_blocks, 2, block_size, heads_of(rank), head_dim]``, so a
head range of a block is a strided view (``2 * block_size`` runs of
``heads * head_dim`` elements), and a rank's whole block is one slab. The
split is engine.parallel.sharding's rule (``kv_heads_of``): split when tp
divides num_kv_heads, one replicated head per rank when tp is a multiple.

The layout travels in the handshake fingerprint (``fingerprint_fields``):
the global fields are compared field by field as before, ``tp_size`` and
``kv_heads`` (per rank ``start-stop``) may differ between the peers, and the
plan between them (reshard.py) must cover every decode rank exactly once.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvtransfer.reshard import TransferPlan, check_plan, plan_transfer

LAYOUT_FIELDS = ("tp_size", "kv_heads")  # may differ between a sender and a receiver
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

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size", "tp_size"):
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

    def heads_of(self, rank: int) -> range:
        """The global KV heads rank `rank`'s cache holds, in its cache's order."""
        return self.rank_heads[rank]

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
                "kv_heads": ",".join(f"{h.start}-{h.stop}" for h in self.rank_heads)}

    @classmethod
    def from_fingerprint(cls, fp: dict[str, str]) -> KVLayout:
        """The layout a peer advertised (its ``kv_heads`` as given; without one, the sharding rule's)."""
        try:
            num = {k: int(fp[k]) for k in ("num_layers", "num_kv_heads", "head_dim", "block_size")}
            tp = int(fp.get("tp_size", "1"))
            heads = None
            if "kv_heads" in fp:
                heads = tuple(range(int(a), int(b)) for a, b in (p.split("-") for p in fp["kv_heads"].split(",")))
            return cls(**num, dtype=fp["dtype"], tp_size=tp, rank_heads=heads)
        except KeyError as e:
            raise ValueError(f"fingerprint has no {e.args[0]!r}: no KV layout") from None
        except ValueError as e:
            raise ValueError(f"fingerprint's KV layout is malformed: {e}") from None

    def plan_to(self, dst: KVLayout) -> TransferPlan:
        """The checked plan from this (prefill) layout into `dst` (decode); PlanError names what is wrong."""
        plan = plan_transfer(self.num_layers, self.rank_heads, dst.rank_heads)
        check_plan(plan)
        return plan

    def check_caches(self, rank_caches) -> None:
        """ValueError unless `rank_caches` (rank -> layer -> tensor) has this layout's shapes and dtype."""
        if len(rank_caches) != self.tp_size:
            raise ValueError(f"kv_caches: {len(rank_caches)} ranks, the layout has tp_size {self.tp_size}")
        for rank, layers in enumerate(rank_caches):
            if len(layers) != self.num_layers:
                raise ValueError(f"kv_caches: rank {rank} has {len(layers)} layers, expected {self.num_layers}")
            want = (2, self.block_size, len(self.heads_of(rank)), self.head_dim)
            for layer, kv in enumerate(layers):
                if tuple(kv.shape[1:]) != want or kv.element_size() != _ITEMSIZE[self.dtype]:
                    raise ValueError(f"kv_caches: rank {rank} layer {layer} is {list(kv.shape)} {kv.dtype}, "
                                     f"expected [num_blocks, {', '.join(map(str, want))}] {self.dtype}")

    @classmethod
    def of_caches(cls, kv_caches, dtype: str | None = None) -> KVLayout:
        """The one-rank layout of a TP=1 cache (``layer -> [num_blocks, 2, block_size, heads, head_dim]``)."""
        from engine.kv_cache import dtype_name

        _, _, block_size, heads, head_dim = kv_caches[0].shape
        return cls(len(kv_caches), int(heads), int(head_dim), int(block_size), dtype or dtype_name(kv_caches[0].dtype))


def with_layout(fingerprint: dict[str, str], layout: KVLayout) -> dict[str, str]:
    """`fingerprint` carrying `layout`: its global num_kv_heads, tp_size and per-rank heads.

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
    memory by its TPGroup): what a stage hands its KVSender / KVReceiver."""
    from engine.kv_cache import dtype_name

    tp = core.config.tensor_parallel_size
    spec = core.kv_spec
    layout = KVLayout(spec.num_layers, core.model_config.num_kv_heads, spec.head_dim, spec.block_size,
                      dtype_name(core.kv_caches[0].dtype), tp)
    caches = core.tp_group.rank_kv_caches() if core.tp_group is not None else [core.kv_caches]
    return layout, caches
