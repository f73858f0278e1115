"""Copies between a layer's block slabs and flat byte buffers, kept off torch's intra-op pool on CPU.

torch spreads a multi-MB CPU copy over its intra-op (OpenMP) threads. When
the cores are busy (the transfer's own I/O threads, the engine, other
processes) the parallel region waits for a thread that is not scheduled
(BENCHMARKS.md, "Measured design choices"). A memory copy is bound by bandwidth, not by
cores, so CPU copies here are single numpy calls (one thread, GIL released);
copies that involve a GPU stay with torch.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvtransfer.planner import contiguous_runs


def byte_views(kv_caches: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each layer as ``[num_blocks, slab_bytes]`` uint8, sharing storage."""
    return [kv.view(kv.shape[0], -1).view(torch.uint8) for kv in kv_caches]


def scatter(dst: torch.Tensor, block_ids: Sequence[int], src: torch.Tensor) -> None:
    """``dst[block_ids[i]] = src[i]`` for every i, in one copy where the CPU allows.

    dst: ``[num_blocks, slab_bytes]`` uint8 (one layer); src: ``[len(block_ids), slab_bytes]`` uint8.
    """
    runs = contiguous_runs(block_ids)
    if dst.device.type == "cpu" and src.device.type == "cpu":
        d, s = dst.numpy(), src.numpy()
        if len(runs) == 1:
            first, n = runs[0]
            np.copyto(d[first:first + n], s)
        else:
            d[np.asarray(block_ids, dtype=np.int64)] = s
        return
    offset = 0
    for first, n in runs:
        dst[first:first + n].copy_(src[offset:offset + n])
        offset += n


def gather(src: list[torch.Tensor], layers: range, block_ids: Sequence[int],
           out: torch.Tensor | None = None) -> torch.Tensor:
    """The slabs ``src[layer][block_ids]`` of each layer, layer-major, as ``[len(layers) * n, slab_bytes]``.

    A view when they are one contiguous run of one layer; otherwise copied into
    ``out`` (a flat uint8 buffer of the right size) or a fresh tensor.
    """
    runs = contiguous_runs(block_ids)
    n, slab = len(block_ids), src[layers[0]].shape[1]
    if len(layers) == 1 and len(runs) == 1:
        first, _ = runs[0]
        return src[layers[0]][first:first + n]
    if out is None:
        out = torch.empty(len(layers) * n * slab, dtype=torch.uint8, device=src[layers[0]].device)
    out = out.view(len(layers), n, slab)  # [layers, blocks, slab_bytes]
    if src[layers[0]].device.type == "cpu":
        o, ids = out.numpy(), np.asarray(block_ids, dtype=np.int64)
        for i, layer in enumerate(layers):
            if len(runs) == 1:
                np.copyto(o[i], src[layer].numpy()[runs[0][0]:runs[0][0] + n])
            else:
                np.take(src[layer].numpy(), ids, axis=0, out=o[i])
    else:
        torch.cat([src[layer][b:b + k] for layer in layers for b, k in runs], out=out.view(-1, slab))
    return out.view(-1, slab)


# ---- head ranges (heterogeneous tensor parallelism) --------------------------
# A rank's layer as ``[num_blocks, rows, heads, head_bytes]`` uint8, rows = 2 * block_size (keys, then
# values): the engine's heads-inner layout, so a head range of a block is ``rows`` strided runs of
# ``heads * head_bytes`` bytes, and all of a rank's heads are the whole slab.
def head_views(kv_caches: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each layer ``[num_blocks, 2, block_size, heads, head_dim]`` as ``[num_blocks, 2 * block_size, heads,
    head_dim * itemsize]`` uint8, sharing storage."""
    return [kv.view(torch.uint8).view(kv.shape[0], kv.shape[1] * kv.shape[2], kv.shape[3], -1) for kv in kv_caches]


def rank_views(rank_caches: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
    """rank -> layer -> head view (``head_views``) of every rank's cache."""
    return [head_views(layers) for layers in rank_caches]


def as_slabs(layers: list[torch.Tensor]) -> list[torch.Tensor]:
    """Head views back as ``[num_blocks, slab_bytes]`` (no copy); None (a layer another pipeline rank holds)
    stays None."""
    return [hv if hv is None else hv.view(hv.shape[0], -1) for hv in layers]


def gather_heads(src: list[torch.Tensor], layers: range, block_ids: Sequence[int], head: int, num_heads: int,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """Local heads ``[head, head + num_heads)`` of the blocks ``src[layer][block_ids]`` of each layer,
    layer-major, as ``[len(layers) * n, rows * num_heads * head_bytes]``: a strided copy into ``out`` (a flat
    uint8 buffer of that size) or a fresh tensor. All of the rank's heads: ``gather`` (a view when it can)."""
    first = src[layers[0]]
    nb, rows, heads, hb = first.shape
    if head == 0 and num_heads == heads:
        return gather(as_slabs(src), layers, block_ids, out)
    n = len(block_ids)
    if out is None:
        out = torch.empty(len(layers) * n * rows * num_heads * hb, dtype=torch.uint8, device=first.device)
    o = out.view(len(layers), n, rows, num_heads, hb)  # [layers, blocks, rows, heads, head_bytes]
    runs = contiguous_runs(block_ids)
    heads_of = slice(head, head + num_heads)
    if first.device.type == "cpu":  # one numpy copy per layer (a fancy index over scattered blocks)
        on, ids = o.numpy(), np.asarray(block_ids, dtype=np.int64)
        for i, layer in enumerate(layers):
            s = src[layer].numpy()
            if len(runs) == 1:
                np.copyto(on[i], s[runs[0][0]:runs[0][0] + n, :, heads_of])
            else:
                on[i] = s[ids, :, heads_of]
    else:
        for i, layer in enumerate(layers):
            offset = 0
            for first, k in runs:
                o[i, offset:offset + k].copy_(src[layer][first:first + k, :, heads_of])
                offset += k
    return out.view(len(layers) * n, -1)


def scatter_heads(dst: torch.Tensor, block_ids: Sequence[int], head: int, src: torch.Tensor) -> None:
    """``dst[block_ids[i], :, head:head + k] = src[i]``: src ``[len(block_ids), rows, k, head_bytes]`` into
    one layer's head view, in one strided copy where the CPU allows."""
    heads_of = slice(head, head + src.shape[2])
    runs = contiguous_runs(block_ids)
    if dst.device.type == "cpu" and src.device.type == "cpu":
        d, s = dst.numpy(), src.numpy()
        if len(runs) == 1:
            np.copyto(d[runs[0][0]:runs[0][0] + len(block_ids), :, heads_of], s)
        else:
            d[np.asarray(block_ids, dtype=np.int64), :, heads_of] = s
        return
    offset = 0
    for first, n in runs:
        dst[first:first + n, :, heads_of].copy_(src[offset:offset + n])
        offset += n
