"""Attention over the paged KV cache for a ragged batch.

A batch holds decode tokens (one query each) and prefill chunks (several
queries that continue whatever prefix is already cached). The runner sorts
decode sequences first, so the batch is ``[decode tokens | prefill chunks]``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    query_start: int  # offset of the chunk's first token in the batch
    num_queries: int
    context_len: int  # cached tokens + this chunk's tokens
    block_table: torch.Tensor  # [num_blocks_for_context] int64

    @property
    def num_cached(self) -> int:
        return self.context_len - self.num_queries


@dataclass
class BatchMetadata:
    """What attention needs to know about the batch beyond the tokens."""

    slot_blocks: torch.Tensor  # [num_tokens] block id of each new token's slot
    slot_offsets: torch.Tensor  # [num_tokens] offset within that block
    num_decode: int = 0  # decode tokens come first in the batch
    decode_block_tables: torch.Tensor | None = None  # [num_decode, max_blocks] int64 (padded with 0)
    decode_context_lens: torch.Tensor | None = None  # [num_decode]
    decode_mask: torch.Tensor | None = None  # [num_decode, 1, 1, max_blocks*block_size] bool; None: made from the lens where needed
    prefills: list[PrefillChunk] = field(default_factory=list)


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: BatchMetadata) -> None:
    # kv_cache: [num_blocks, 2, block_size, kv_heads, head_dim]; k, v: [tokens, kv_heads, head_dim]
    kv_cache[meta.slot_blocks, 0, meta.slot_offsets] = k
    kv_cache[meta.slot_blocks, 1, meta.slot_offsets] = v


def _gather(kv_cache: torch.Tensor, block_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # block_table: [..., nb] -> k, v: [..., nb*block_size, kv_heads, head_dim]
    blocks = kv_cache[block_table]  # [..., nb, 2, bs, H, D]
    shape = (*block_table.shape[:-1], -1, blocks.shape[-2], blocks.shape[-1])
    return blocks.select(-4, 0).reshape(shape), blocks.select(-4, 1).reshape(shape)


def paged_attention(
    q: torch.Tensor,  # [tokens, heads, head_dim]
    k: torch.Tensor,  # [tokens, kv_heads, head_dim]
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: BatchMetadata,
    scale: float,
    decode_impl=None,  # a fused kernel for the decode part (engine.kernels), or None
) -> torch.Tensor:  # [tokens, heads, head_dim]
    write_kv(kv_cache, k, v, meta)
    out = torch.empty_like(q)
    nd = meta.num_decode
    if nd:
        out[:nd] = (decode_impl or _decode_attention)(q[:nd], kv_cache, meta, scale)
    for p in meta.prefills:
        s, n = p.query_start, p.num_queries
        qp = q[s:s + n].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if p.num_cached == 0:
            kp, vp = k[s:s + n], v[s:s + n]
            mask, causal = None, True
        else:
            kp, vp = _gather(kv_cache, p.block_table)
            kp, vp = kp[: p.context_len], vp[: p.context_len]
            # query i sits at position num_cached + i and sees keys 0..num_cached+i
            qpos = torch.arange(p.num_cached, p.context_len, device=q.device).unsqueeze(1)
            mask = torch.arange(p.context_len, device=q.device).unsqueeze(0) <= qpos  # [n, ctx]
            causal = False
        o = F.scaled_dot_product_attention(
            qp, kp.transpose(0, 1).unsqueeze(0), vp.transpose(0, 1).unsqueeze(0),
            attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True,
        )
        out[s:s + n] = o.squeeze(0).transpose(0, 1)
    return out


def _decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, meta: BatchMetadata, scale: float) -> torch.Tensor:
    # One query per sequence: two small batched matmuls beat SDPA's kernel
    # launch cost here. q: [B, H, D] -> [B, H, D]
    B, H, D = q.shape
    k, v = _gather(kv_cache, meta.decode_block_tables)  # [B, L, Hkv, D]
    Hkv = k.shape[2]
    qg = q.view(B, Hkv, H // Hkv, D)
    scores = torch.matmul(qg, k.permute(0, 2, 3, 1)).float()  # [B, Hkv, G, L]
    if meta.decode_mask is None and int(meta.decode_context_lens.min()) < k.shape[1]:
        # padded tables: the padding's mask, made by the step's first layer and kept for the others
        lens = meta.decode_context_lens.to(q.device)
        meta.decode_mask = (torch.arange(k.shape[1], device=q.device) < lens.unsqueeze(1))[:, None, None, :]
    if meta.decode_mask is not None:
        scores.masked_fill_(~meta.decode_mask, float("-inf"))
    probs = torch.softmax(scores * scale, dim=-1).to(q.dtype)
    return torch.matmul(probs, v.transpose(1, 2)).view(B, H, D)  # [B, Hkv, G, D]
