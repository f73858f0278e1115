"""Mixture-of-experts MLP layers (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE): routing, grouped expert
compute, combine; and the checkpoint layouts their experts come in.

A sparse layer's MLP is a `MoEBlock`. Routing is the reference's: softmax of
the router logits in float32, ``torch.topk`` (so ties break as it breaks them),
the top-k weights renormalized where the config says (`norm_topk_prob`).
Expert compute is grouped: the (token, slot) pairs are sorted by expert
(a stable sort, so within one expert they stay in token order), each expert
gathers its tokens with ``index_select`` and runs one gate|up and one down
matmul through the same ops as the dense MLP, and its weighted output is
``index_add``-ed into the result, experts in ascending id order. A token's
output is therefore the sum of its own experts' outputs, added in the same
order whatever else is in the batch: the combine is batch invariant exactly
where the matmuls are.

A block holds only the experts its rank was given (`ShardLayout.experts`), each
possibly cut to a column range (tensor parallelism without expert
parallelism). `forward` is the ``allreduce`` dispatch's part: this rank's
partial sum over every token, which the MLP all-reduce completes; the
``alltoall`` dispatch instead calls `route`, `expert` and `add_shared` on the
rows it moved (engine/parallel/moe.py has both).

Checkpoints: the model takes experts by the per-expert names
(``mlp.experts.{j}.gate_proj.weight`` …, `expert_names`). `checkpoint_sources`
maps a file's tensor names onto those: Mixtral's original layout
(``block_sparse_moe.experts.{j}.w1/w3/w2``, router ``block_sparse_moe.gate``)
and the packed one transformers 5 writes with ``save_original_format=False``
(``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj`` [E, H, I]).
A GGUF file's stacked experts (``blk.N.ffn_{gate,up,down}_exps``) are split onto the same
names by engine.gguf_convert (dequantized) or engine.gguf_blocks.read_gguf_rows (quantization
"gguf": each expert's blocks kept, then computed on by the quantized kernels like a dense
MLP's; the router stays fp32).
"""
from __future__ import annotations

import re
from collections.abc import Callable

import torch

from engine.config import ModelConfig
from engine.quant import fuse_rows

# Mixtral's original names for an expert's matmuls -> the per-expert names the model takes
_MIXTRAL_W = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_MIXTRAL_EXPERT = re.compile(r"^(model\.layers\.\d+\.)block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight$")
_MIXTRAL_ROUTER = re.compile(r"^(model\.layers\.\d+\.)block_sparse_moe\.gate\.weight$")
_PACKED = re.compile(r"^(model\.layers\.(\d+)\.mlp\.experts\.)(gate_up_proj|down_proj)$")


def expert_name(layer: int, expert: int, proj: str) -> str:
    return f"model.layers.{layer}.mlp.experts.{expert}.{proj}.weight"


def layer_shapes(cfg: ModelConfig, layer: int, experts=None) -> dict[str, tuple[int, ...]]:
    """The tensors of sparse layer `layer`'s MLP and their full shapes: the router, each expert
    in `experts` (default all) and, for Qwen2-MoE, the shared expert and its gate."""
    h, i = cfg.hidden_size, cfg.moe_intermediate_size
    p = f"model.layers.{layer}.mlp."
    shapes = {p + "gate.weight": (cfg.num_experts, h)}
    for e in range(cfg.num_experts) if experts is None else experts:
        shapes.update({expert_name(layer, e, "gate_proj"): (i, h), expert_name(layer, e, "up_proj"): (i, h),
                       expert_name(layer, e, "down_proj"): (h, i)})
    s = cfg.shared_expert_intermediate_size
    if s:
        shapes.update({p + "shared_expert.gate_proj.weight": (s, h), p + "shared_expert.up_proj.weight": (s, h),
                       p + "shared_expert.down_proj.weight": (h, s), p + "shared_expert_gate.weight": (1, h)})
    return shapes


Reader = Callable[[], torch.Tensor]


class LayoutError(ValueError):
    """A packed expert tensor does not have the shape the config implies (the message names it)."""


def checkpoint_sources(cfg: ModelConfig, name: str, shape: tuple[int, ...], get_slice) -> list[tuple[str, Reader]]:
    """The model tensors a checkpoint tensor `name` (of `shape`) provides, each with a reader.

    get_slice: the file's ``safe_open(...).get_slice(name)`` (read lazily: a packed tensor is
    read one expert at a time). A name no MoE layout knows maps to itself.
    """
    if not cfg.is_moe:
        return [(name, lambda: get_slice(name)[:])]
    m = _MIXTRAL_EXPERT.match(name)
    if m:
        layer = int(m.group(1).split(".")[2])
        return [(expert_name(layer, int(m.group(2)), _MIXTRAL_W[m.group(3)]), lambda: get_slice(name)[:])]
    m = _MIXTRAL_ROUTER.match(name)
    if m:
        return [(m.group(1) + "mlp.gate.weight", lambda: get_slice(name)[:])]
    m = _PACKED.match(name)
    if not m:
        return [(name, lambda: get_slice(name)[:])]
    layer, kind = int(m.group(2)), m.group(3)
    E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    want = (E, 2 * I, H) if kind == "gate_up_proj" else (E, H, I)
    if tuple(shape) != want:
        raise LayoutError(f"tensor {name!r} has shape {list(shape)}, expected {list(want)} from config.json")

    def part(e: int, rows: slice | None) -> Reader:
        def read() -> torch.Tensor:
            t = get_slice(name)[e:e + 1]
            return (t[0] if rows is None else t[0, rows]).contiguous()
        return read

    if kind == "down_proj":
        return [(expert_name(layer, e, "down_proj"), part(e, None)) for e in range(E)]
    out = []
    for e in range(E):  # gate_up_proj: the gate's rows first, then the up projection's
        out += [(expert_name(layer, e, "gate_proj"), part(e, slice(0, I))),
                (expert_name(layer, e, "up_proj"), part(e, slice(I, 2 * I)))]
    return out


class MoEBlock:
    """One sparse MLP as one rank holds it; weights as plain tensors (or PackedWeight once packed)."""

    __slots__ = ("num_experts", "top_k", "norm_topk_prob", "experts", "router_w", "gate_up_w", "down_w",
                 "shared_gate_up_w", "shared_down_w", "shared_gate_w")

    def __init__(self, cfg: ModelConfig, layer: int, experts: tuple[int, ...], intermediate: int,
                 shared_intermediate: int, take):
        """take(name, shape): the tensor as this rank holds it (engine.model._WeightTaker.take);
        `experts` the ids this rank holds, each cut to `intermediate` columns by the sharding plan
        (and the shared expert to `shared_intermediate`)."""
        H, I, S = cfg.hidden_size, intermediate, shared_intermediate
        self.num_experts, self.top_k, self.norm_topk_prob = cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.experts = experts
        p = f"model.layers.{layer}.mlp."
        self.router_w = take(p + "gate.weight", (cfg.num_experts, H))
        self.gate_up_w = [fuse_rows([take(expert_name(layer, e, "gate_proj"), (I, H)),
                                     take(expert_name(layer, e, "up_proj"), (I, H))], f"{p}experts.{e}.gate|up_proj")
                          for e in experts]
        self.down_w = [take(expert_name(layer, e, "down_proj"), (H, I)) for e in experts]
        if cfg.shared_expert_intermediate_size:
            self.shared_gate_up_w = fuse_rows([take(p + "shared_expert.gate_proj.weight", (S, H)),
                                               take(p + "shared_expert.up_proj.weight", (S, H))],
                                              p + "shared_expert.gate|up_proj")
            self.shared_down_w = take(p + "shared_expert.down_proj.weight", (H, S))
            self.shared_gate_w = take(p + "shared_expert_gate.weight", (1, H))
        else:
            self.shared_gate_up_w = self.shared_down_w = self.shared_gate_w = None

    def matmul_weights(self, routers: bool = True) -> list[tuple[object, str, int | None]]:
        """(holder, attribute, index in its list or None) of every matmul weight, for packing;
        without the router and the shared expert's gate where `routers` is false."""
        slots = [(self, "router_w", None)] if routers else []
        slots += [(self, "gate_up_w", j) for j in range(len(self.experts))]
        slots += [(self, "down_w", j) for j in range(len(self.experts))]
        if self.shared_gate_up_w is not None:
            slots += [(self, "shared_gate_up_w", None), (self, "shared_down_w", None)]
            slots += [(self, "shared_gate_w", None)] if routers else []
        return slots

    def map_weights(self, fn, routers: bool = True) -> None:
        """Replace every matmul weight w by fn(w) (packing them for the native kernels, quantizing
        them: then `routers` false keeps the routing matmuls as they are)."""
        for obj, name, j in self.matmul_weights(routers):
            if j is None:
                setattr(obj, name, fn(getattr(obj, name)))
            else:
                getattr(obj, name)[j] = fn(getattr(obj, name)[j])

    @property
    def nbytes(self) -> int:
        total = 0
        for obj, name, j in self.matmul_weights():
            w = getattr(obj, name) if j is None else getattr(obj, name)[j]
            total += w.nbytes if not isinstance(w, torch.Tensor) else w.numel() * w.element_size()
        return total

    def route(self, h: torch.Tensor, linear) -> tuple[torch.Tensor, torch.Tensor]:
        # h: [T, H] -> weights [T, k] (h's dtype), expert ids [T, k]
        probs = torch.softmax(linear(h, self.router_w).float(), dim=-1)  # [T, E]
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(h.dtype), ids

    def expert(self, j: int, x: torch.Tensor, ops) -> torch.Tensor:
        """x: [n, H], rows routed to held expert ``self.experts[j]`` -> its output [n, H], unweighted."""
        return ops.linear(ops.silu_mul(ops.linear(x, self.gate_up_w[j])), self.down_w[j])

    def add_shared(self, out: torch.Tensor, h: torch.Tensor, ops) -> torch.Tensor:
        """out + the gated shared expert on h (Qwen2-MoE: a dense expert every token takes); [T, H]."""
        if self.shared_gate_up_w is None:
            return out
        linear = ops.linear
        shared = linear(ops.silu_mul(linear(h, self.shared_gate_up_w)), self.shared_down_w)  # [T, H]
        return out + torch.sigmoid(linear(h, self.shared_gate_w)) * shared

    def forward(self, h: torch.Tensor, ops) -> tuple[torch.Tensor, torch.Tensor]:
        """h: [T, H] -> (this rank's partial MLP output [T, H], tokens routed to each expert [E])."""
        k = self.top_k
        weights, ids = self.route(h, ops.linear)
        flat = ids.flatten()  # [T * k]: pair p is token p // k's slot p % k
        counts = torch.bincount(flat, minlength=self.num_experts)  # [E]
        order = torch.argsort(flat, stable=True)  # pairs grouped by expert, in token order within one
        ends = counts.cumsum(0).tolist()
        n = counts.tolist()
        flat_w = weights.flatten()
        out = torch.zeros_like(h)
        for j, e in enumerate(self.experts):  # ascending expert ids: a fixed combine order
            if n[e] == 0:
                continue
            pairs = order[ends[e] - n[e]: ends[e]]  # [n_e]
            tokens = pairs // k
            y = self.expert(j, h.index_select(0, tokens), ops)  # [n_e, H]
            out.index_add_(0, tokens, y * flat_w.index_select(0, pairs).unsqueeze(1))
        return self.add_shared(out, h, ops), counts
