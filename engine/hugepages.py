"""Weights in transparent huge pages (Linux, CPU).

A decode step streams every weight from memory once. With 4 KiB pages the
CPU's hardware prefetchers stop at every page boundary and each page costs a
TLB miss; with 2 MiB pages a weight matrix is a few pages and the prefetchers
run through it (measured: BENCHMARKS.md, "Measured design choices"). Most
Linux machines ship with transparent huge pages in
`madvise` mode, so the memory has to ask for them: `pack` copies tensors into
one 2 MiB-aligned arena that is advised MADV_HUGEPAGE before it is touched.
"""
from __future__ import annotations

import logging
import math
import mmap

import torch

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
_ALIGN = 64  # each tensor starts on a cache line


def _huge_arena(size: int) -> torch.Tensor | None:
    """`size` bytes of fresh anonymous memory (its own mapping, whatever the
    malloc tuning), 2 MiB-aligned and advised MADV_HUGEPAGE before any page
    is touched; None where the kernel refuses."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    mm = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # shared: no THP
    raw = torch.frombuffer(mm, dtype=torch.uint8)  # keeps `mm` alive
    base = -raw.data_ptr() % HUGE_PAGE
    try:
        mm.madvise(mmap.MADV_HUGEPAGE, base, -(-size // HUGE_PAGE) * HUGE_PAGE)
    except OSError:
        return None
    return raw[base:base + size]


def zeros(shapes: list[tuple[int, ...]], dtype: torch.dtype) -> list[torch.Tensor] | None:
    """Zeroed CPU tensors of these shapes in one huge-page arena (fresh
    anonymous memory reads as zeros, and only pages written are backed), or
    None where huge pages are unavailable."""
    sizes = [-(-math.prod(s) * dtype.itemsize // _ALIGN) * _ALIGN for s in shapes]
    arena = _huge_arena(sum(sizes)) if sum(sizes) >= HUGE_PAGE else None
    if arena is None:
        return None
    out, off = [], 0
    for shape, size in zip(shapes, sizes):
        out.append(arena[off:off + math.prod(shape) * dtype.itemsize].view(dtype).view(shape))
        off += size
    return out


def pack(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of `tensors` (CPU, contiguous) laid out in one arena backed by
    huge pages where the kernel allows; the inputs themselves where it does
    not, or where they are too small to matter. The same input object twice
    (tied weights) gives the same output object twice."""
    unique: dict[int, torch.Tensor] = {}
    for t in tensors:
        unique.setdefault(id(t), t)
    if any(t.device.type != "cpu" for t in unique.values()):
        return tensors
    offsets: dict[int, int] = {}
    size = 0
    for key, t in unique.items():
        offsets[key] = size
        size += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    if size < HUGE_PAGE:
        return tensors
    arena = _huge_arena(size)
    if arena is None:
        log.info("weights: transparent huge pages unavailable, keeping 4 KiB pages")
        return tensors
    packed: dict[int, torch.Tensor] = {}
    for key, t in unique.items():
        nbytes = t.numel() * t.element_size()
        view = arena[offsets[key]:offsets[key] + nbytes].view(t.dtype).view(t.shape)
        view.copy_(t)
        packed[key] = view
    return [packed[id(t)] for t in tensors]
