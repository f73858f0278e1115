"""The Llama family of decoders: dense (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2) and
mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE): a layer's MLP is dense or an
`engine.moe.MoEBlock`, as the checkpoint's config says.

The model is a pure function of (tokens, positions, batch metadata, KV cache):
``forward`` writes each layer's new keys and values into the paged cache and
returns the final hidden states. Sampling positions are picked by the caller.
Weights are taken in Hugging Face naming and fused at load (q|k|v, gate|up).

Tensor parallelism is applied from outside: the weights come already cut by
`engine.parallel.sharding` for one rank (`shard` says which heads, MLP columns
and vocabulary rows), and the collectives are injected (`comm`: an all-reduce
after o_proj, after down_proj and after the vocab-parallel embedding, and a
gather of the vocab-parallel logits; OLMoE's full-width q/k norm all-reduces its [T, 2]
sums of squares). At TP=1 both are no-ops.
Pipeline parallelism too: `shard.layers` names the contiguous global layers this
rank builds (the embedding only on the first stage, the final norm and LM head
only on the last), and ``forward`` of a later stage takes the previous stage's
residual stream (``hidden``) instead of token ids and returns its own (the final
normed hidden states on the last stage). Layer ids stay global in the weights'
names and in the layer hook; ``kv_caches`` holds this rank's layers only. A sparse layer's
MLP output is this rank's partial sum (its experts, or its columns of every
expert) and takes the same one all-reduce as the dense MLP's down_proj.

Quantization is applied from outside too: `quantization` "int8" quantizes the
fp32 matmul weights at load (engine.quant), "gguf" takes them as the GGUF file
stores them (engine.quant.QuantRows in `weights`); either way they are packed
into engine.quant.QuantWeight and the model computes in fp32 on them
(engine.kernels.QuantOps).
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.attention import BatchMetadata, paged_attention
from engine.config import ConfigError, ModelConfig
from engine.kernels import MAX_FUSED_ROWS, PackedWeight, make_ops
from engine.moe import MoEBlock
from engine.parallel.comm import SINGLE, Collectives
from engine.parallel.moe import make_dispatch
from engine.parallel.sharding import ShardLayout
from engine.quant import QuantRows, QuantWeight, fuse_rows, quantize_int8

LayerHook = Callable[[int], None]


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    rs = cfg.rope_scaling or {}
    kind = rs.get("rope_type", rs.get("type"))
    if kind == "linear":
        inv_freq = inv_freq / float(rs["factor"])
    elif kind == "llama3":
        factor = float(rs["factor"])
        low, high = float(rs.get("low_freq_factor", 1.0)), float(rs.get("high_freq_factor", 4.0))
        old_ctx = float(rs["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    return inv_freq.float()


class Rotary:
    """Precomputed cos/sin tables; applied in the rotate-half (HF) layout."""

    def __init__(self, cfg: ModelConfig, max_positions: int, dtype: torch.dtype, device):
        inv_freq = rope_inv_freq(cfg)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [P, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [P, D]
        self.cos = emb.cos().to(dtype=dtype, device=device)
        sin = emb.sin()
        half = sin.shape[-1] // 2
        # rotate_half(x) * sin == roll(x, D/2) * (sin with its first half negated)
        self.sin = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1).to(dtype=dtype, device=device)

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [T, heads, D]; cos, sin: [T, 1, D]
        return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


class Layer:
    __slots__ = ("in_norm", "post_norm", "qkv_w", "qkv_b", "o_w", "gate_up_w", "down_w", "q_norm", "k_norm")


class LlamaModel:
    """Weights as plain tensors; no nn.Module machinery on the hot path."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: str | torch.device = "cpu", max_positions: int | None = None,
                 use_kernels: bool = True, kernel_isa: str = "auto", shard: ShardLayout | None = None,
                 comm: Collectives | None = None, quantization: str = "none", moe_dispatch: str = "allreduce"):
        self.cfg = cfg
        self.quantization = quantization
        self.shard = shard = shard or ShardLayout.for_rank(cfg, 0, 1)
        self.comm = comm or SINGLE
        # a sparse layer's MLP across the ranks, by name (engine/parallel/moe.py)
        self.expert_dispatch = make_dispatch(moe_dispatch, self.comm, shard.expert_owner) if cfg.is_moe else None
        self.dtype = dtype
        self.device = torch.device(device)
        self.scale = cfg.head_dim ** -0.5
        self.q_size = shard.num_heads * cfg.head_dim  # this rank's heads
        self.kv_size = shard.num_kv_heads * cfg.head_dim
        w = _WeightTaker(weights, dtype, self.device)
        layers = shard.layers if shard.layers is not None else range(cfg.num_layers)
        self.layer_start = layers.start  # global id of self.layers[0]
        self.is_first_stage, self.is_last_stage = shard.is_first_stage, shard.is_last_stage
        tied_here = self.is_last_stage and cfg.tie_word_embeddings and "lm_head.weight" not in weights
        self.embed = (w.take("model.embed_tokens.weight", (shard.vocab_shard, cfg.hidden_size))
                      if self.is_first_stage or tied_here else None)
        self.layers: list[Layer] = []
        self.moe: list[MoEBlock | None] = [None] * cfg.num_layers  # a sparse layer's MLP
        # tokens routed to each expert, per sparse layer, since the model was built (EngineCore.expert_load)
        self.expert_counts = torch.zeros(len(cfg.moe_layers), max(cfg.num_experts, 1), dtype=torch.int64)
        sparse = set(cfg.moe_layers)
        H, I = cfg.hidden_size, shard.intermediate_size
        for i in layers:
            p = f"model.layers.{i}."
            L = Layer()
            L.in_norm = w.take(p + "input_layernorm.weight", (H,))
            L.post_norm = w.take(p + "post_attention_layernorm.weight", (H,))
            L.qkv_w = fuse_rows([
                w.take(p + "self_attn.q_proj.weight", (self.q_size, H)),
                w.take(p + "self_attn.k_proj.weight", (self.kv_size, H)),
                w.take(p + "self_attn.v_proj.weight", (self.kv_size, H)),
            ], p + "self_attn.q|k|v_proj")
            L.qkv_b = torch.cat([
                w.take(p + "self_attn.q_proj.bias", (self.q_size,)),
                w.take(p + "self_attn.k_proj.bias", (self.kv_size,)),
                w.take(p + "self_attn.v_proj.bias", (self.kv_size,)),
            ]) if cfg.attention_bias else None
            L.o_w = w.take(p + "self_attn.o_proj.weight", (H, self.q_size))
            if i in sparse:
                L.gate_up_w = L.down_w = None
                self.moe[i] = MoEBlock(cfg, i, shard.experts, shard.moe_intermediate_size,
                                       shard.shared_intermediate_size, w.take)
            else:
                L.gate_up_w = fuse_rows([
                    w.take(p + "mlp.gate_proj.weight", (I, H)),
                    w.take(p + "mlp.up_proj.weight", (I, H)),
                ], p + "mlp.gate|up_proj")
                L.down_w = w.take(p + "mlp.down_proj.weight", (H, I))
            if cfg.qk_norm:  # per head, or (OLMoE) over this rank's heads' width
                q_w, k_w = (self.q_size, self.kv_size) if cfg.qk_norm_full_width else (cfg.head_dim, cfg.head_dim)
                L.q_norm = w.take(p + "self_attn.q_norm.weight", (q_w,))
                L.k_norm = w.take(p + "self_attn.k_norm.weight", (k_w,))
            else:
                L.q_norm = L.k_norm = None
            self.layers.append(L)
        self.norm = self.lm_head = None  # (a pipeline stage before the last)
        if self.is_last_stage:
            self.norm = w.take("model.norm.weight", (H,))
            if "lm_head.weight" in weights:
                self.lm_head = w.take("lm_head.weight", (shard.vocab_shard, H))
            elif cfg.tie_word_embeddings:
                self.lm_head = self.embed
            else:
                raise ConfigError("checkpoint: missing tensor 'lm_head.weight' (and tie_word_embeddings is false)")
        self.rotary = Rotary(cfg, max_positions or cfg.max_position_embeddings, dtype, self.device)
        if quantization == "none" and any(isinstance(t, QuantRows) for t in weights.values()):
            raise ConfigError("checkpoint: holds quantized weights (read for quantization 'gguf'), "
                              "but quantization is 'none'")
        self.select_kernels(kernel_isa if use_kernels else "none")
        if self.device.type == "cpu" and not isinstance(self.layers[0].qkv_w, (PackedWeight, QuantWeight)):
            self._to_huge_pages()  # (packed and quantized weights moved there when they were made)

    def select_kernels(self, kernel_isa: str) -> None:
        """Run on the ops of `kernel_isa` (engine.kernels.make_ops; a ValueError where
        this machine cannot run it). Every native ISA reads the same packed weights,
        so switching between them repacks nothing."""
        if self.quantization != "none":
            from engine.kernels import make_quant_ops

            self.ops = make_quant_ops(self.device, kernel_isa)
            if not isinstance(self.lm_head, QuantWeight):
                self._quantize_matmul_weights()
                if self.device.type == "cpu":
                    self._to_huge_pages()
            self.fused = (None if self.shard.is_sharded or self.shard.pp_size > 1 or self.cfg.is_moe
                          else self.ops.fused_decoder(self))
            return
        ops = make_ops(self.dtype, self.device, isa=kernel_isa)
        packed = isinstance(self.layers[0].qkv_w, PackedWeight)
        if packed and not ops.packs_weights:
            raise ValueError(f"kernel_isa: {kernel_isa!r} cannot run a model whose weights are packed")
        self.ops = ops
        if ops.packs_weights and not packed:
            self._pack_matmul_weights()
            if self.device.type == "cpu" and isinstance(self.layers[0].qkv_w, PackedWeight):
                self._to_huge_pages()
        # None: every batch takes the per-op path. FusedDecoder runs the whole stack in one native call,
        # which cannot all-reduce inside it, so a sharded model runs NativeOps.linear etc. on its shards;
        # nor route tokens to experts, so a mixture of experts does too
        # (a pipeline stage runs its layers fused: it takes the previous stage's hidden states, and one
        # before the last returns its residual stream)
        self.fused = None if self.shard.is_sharded or self.cfg.is_moe else ops.fused_decoder(self)

    def _pack_matmul_weights(self) -> None:
        """The matmul weights into the native kernel's layout (engine.kernels.PackedWeight),
        replacing the [N, K] tensors: every matmul, prefill included, runs on the packed
        copy, so the weights are held once. Tied embeddings are looked up in the packed
        LM head (`embed_tokens`)."""
        ks = [w.shape[1] for L in self.layers for w in (L.o_w, L.down_w) if w is not None]
        ks += [self.lm_head.shape[1]] if self.lm_head is not None else []
        ks += [w.shape[1] for m in self.moe if m is not None for w in m.down_w + [m.shared_down_w] if w is not None]
        if any(k % 2 for k in ks):
            return  # the kernel pairs k; an odd size keeps torch's matmul
        for L in self.layers:
            for name in ("qkv_w", "o_w", "gate_up_w", "down_w"):
                if getattr(L, name) is not None:
                    setattr(L, name, PackedWeight.pack(getattr(L, name)))
        for m in self.moe:
            if m is not None:
                m.map_weights(PackedWeight.pack)
        if self.lm_head is None:  # a pipeline stage before the last
            return
        tied = self.lm_head is self.embed
        self.lm_head = PackedWeight.pack(self.lm_head)
        if tied:
            self.embed = None

    def _quantize_matmul_weights(self) -> None:
        """The matmul weights (the experts' too), the LM head and the embeddings as QuantWeight:
        taken as stored where the checkpoint holds them quantized (gguf), else quantized to int8."""
        def quant(w):
            return QuantWeight.pack(w if isinstance(w, QuantRows) else quantize_int8(w))

        for L in self.layers:
            for name in ("qkv_w", "o_w", "gate_up_w", "down_w"):
                if getattr(L, name) is not None:  # (None: a sparse layer's MLP)
                    setattr(L, name, quant(getattr(L, name)))
        for m in self.moe:  # the experts' matmuls; the routers and the shared expert's gate stay fp32
            if m is not None:
                m.map_weights(quant, routers=False)
        tied = self.lm_head is self.embed
        self.lm_head = quant(self.lm_head)
        self.embed = None if tied else quant(self.embed)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        # embed None: tied to the LM head, which is held packed
        table = self.lm_head if self.embed is None else self.embed
        if not self.shard.is_sharded:
            return self.ops.embedding(input_ids, table)
        # vocab-parallel: each rank looks up the ids in its rows, zeros the others, and the sum is the lookup
        local = input_ids - self.shard.vocab_start
        outside = (local < 0) | (local >= self.shard.vocab_shard)
        x = self.ops.embedding(local.masked_fill(outside, 0), table)
        return self.comm.all_reduce(x.masked_fill_(outside.unsqueeze(1), 0))

    def _to_huge_pages(self) -> None:
        """Every weight into one huge-page arena (engine/hugepages.py): decode streams them all each step."""
        from engine.hugepages import pack

        slots = [(self, "embed"), (self, "lm_head"), (self, "norm")]
        slots += [(L, name) for L in self.layers for name in Layer.__slots__]
        slots = [(obj, name) for obj, name in slots if getattr(obj, name) is not None]
        ws = [getattr(obj, name) for obj, name in slots]
        parts = [[w.data] if isinstance(w, PackedWeight) else w.tensors() if isinstance(w, QuantWeight) else [w]
                 for w in ws]
        tensors = iter(pack([t for p in parts for t in p]))
        for (obj, name), w, p in zip(slots, ws, parts):
            got = [next(tensors) for _ in p]
            if isinstance(w, PackedWeight):
                setattr(obj, name, PackedWeight(got[0], w.n, w.k))
            elif isinstance(w, QuantWeight):
                setattr(obj, name, w.with_tensors(*got))
            else:
                setattr(obj, name, got[0])

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        meta: BatchMetadata,
        kv_caches: list[torch.Tensor],
        layer_hook: LayerHook | None = None,
        hidden: torch.Tensor | None = None,  # [T, hidden]: the previous pipeline stage's residual stream
    ) -> torch.Tensor:  # [T, hidden]: normed on the last stage, the residual stream before it
        cfg = self.cfg
        eps = cfg.rms_norm_eps
        T = input_ids.shape[0]
        nh, nkv, hd = self.shard.num_heads, self.shard.num_kv_heads, cfg.head_dim  # this rank's heads
        ops, all_reduce = self.ops, self.comm.all_reduce
        if (self.fused is not None and not meta.prefills and layer_hook is None and T <= MAX_FUSED_ROWS):
            # a batch of decode tokens only: the whole stack in one native call
            return self.fused.forward(self.embed_tokens(input_ids) if hidden is None else hidden, positions,
                                      meta.slot_blocks,
                                      meta.slot_offsets, meta.decode_block_tables, meta.decode_context_lens,
                                      kv_caches, torch.get_num_threads())
        linear = ops.linear
        rope = ops.rope(self.rotary, positions)
        x = self.embed_tokens(input_ids) if hidden is None else hidden  # [T, H]
        h = ops.rms_norm(x, self.layers[0].in_norm, eps)
        first = self.layer_start
        for j, L in enumerate(self.layers):
            i = first + j  # the global layer id
            qkv = linear(h, L.qkv_w)
            if L.qkv_b is not None:
                qkv = qkv + L.qkv_b
            if cfg.qk_norm_full_width:
                qkv = self._full_width_qk_norm(qkv, L, eps)
            if cfg.clip_qkv is not None:
                qkv = qkv.clamp(-cfg.clip_qkv, cfg.clip_qkv)
            qkv = qkv.view(T, nh + 2 * nkv, hd)
            qk, v = qkv[:, : nh + nkv], qkv[:, nh + nkv:]
            if L.q_norm is not None and not cfg.qk_norm_full_width:
                qk = torch.cat([F.rms_norm(qk[:, :nh], (hd,), L.q_norm, eps),
                                F.rms_norm(qk[:, nh:], (hd,), L.k_norm, eps)], dim=1)
            qk = rope(qk)  # q and k rotated in one pass
            q, k = qk[:, :nh], qk[:, nh:]
            attn = paged_attention(q, k, v, kv_caches[j], meta, self.scale, ops.decode_attention)  # [T, nh, hd]
            if layer_hook is not None:
                layer_hook(i)
            # row-parallel o_proj and down_proj: partial sums, one all-reduce each
            x, h = ops.add_rms_norm(x, all_reduce(linear(attn.view(T, self.q_size), L.o_w)), L.post_norm, eps)
            moe = self.moe[i]
            if moe is None:
                mlp = all_reduce(linear(ops.silu_mul(linear(h, L.gate_up_w)), L.down_w))
            else:  # this rank's experts (or columns of each): engine/parallel/moe.py
                mlp, counts = self.expert_dispatch(moe, h, ops)
                self.expert_counts[cfg.moe_layers.index(i)] += counts
            if j + 1 == len(self.layers) and not self.is_last_stage:
                return x + mlp  # the residual stream, for the next stage
            next_norm = self.layers[j + 1].in_norm if j + 1 < len(self.layers) else self.norm
            x, h = ops.add_rms_norm(x, mlp, next_norm, eps)
        return h

    def _full_width_qk_norm(self, qkv: torch.Tensor, L: Layer, eps: float) -> torch.Tensor:
        # qkv: [T, q_size + 2 kv_size] -> the same, q and k RMS-normed over the model's full q / k width
        # (OLMoE). Sharded, each rank holds some heads: the sums of squares of every rank's heads
        # are all-reduced, [T, 2] per layer. A KV head replicated on r ranks is summed r times,
        # and its width counted r times too: the mean is the same.
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=1)
        qf, kf = q.float(), k.float()
        sums = self.comm.all_reduce(torch.stack([qf.pow(2).sum(-1), kf.pow(2).sum(-1)], dim=1))  # [T, 2]
        size = self.shard.size
        q = L.q_norm * (qf * torch.rsqrt(sums[:, :1] / (self.q_size * size) + eps)).to(q.dtype)
        k = L.k_norm * (kf * torch.rsqrt(sums[:, 1:] / (self.kv_size * size) + eps)).to(k.dtype)
        return torch.cat([q, k, v], dim=1)

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:  # [N, vocab] float32
        """The logits of `hidden`'s rows; sharded, only on the rank that samples (None on the others)."""
        logits = self.ops.logits(hidden, self.lm_head)  # [N, vocab_shard]
        if not self.shard.is_sharded:
            return logits
        full = self.comm.gather_vocab(logits)  # [N, size * vocab_shard] on the sampling rank
        return None if full is None else full[:, : self.shard.vocab_size]


class _WeightTaker:
    def __init__(self, weights: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device):
        self.weights, self.dtype, self.device = weights, dtype, device

    def take(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        t = self.weights.get(name)
        if t is None:
            raise ConfigError(f"checkpoint: missing tensor {name!r}")
        if tuple(t.shape) != shape:
            raise ConfigError(f"checkpoint: tensor {name!r} has shape {tuple(t.shape)}, expected {shape}")
        if isinstance(t, QuantRows):  # a GGUF's own blocks: packed as they are (LlamaModel.select_kernels)
            return t
        return t.to(device=self.device, dtype=self.dtype).contiguous()
