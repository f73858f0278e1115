"""Each worker rank's paged KV cache in shared memory, so that rank 0 can map every rank's cache.

A replica's KV transfer endpoint (KVSender on prefill, KVReceiver on decode)
is one per replica, in rank 0's process, yet it reads and writes the caches
of every rank. So rank 0 creates one file per worker rank under /dev/shm
(named after the group's segment: ``<segment>-kv<rank>``), sized for that
rank's heads; the worker maps it as its cache in place of private memory,
rank 0 maps it too, and rank 0 unlinks the files as soon as every worker
reported ready (before that, the group's teardown does; a worker unlinks its
own on the way out too, for a rank 0 killed while the group starts). From
then on the memory lives exactly as long as some process maps it.

Rank 0's own cache stays in its process (huge pages, engine.kv_cache).

The layout inside a file: layer after layer, each the engine's
``[num_blocks, 2, block_size, num_kv_heads, head_dim]`` tensor, page-aligned.

On CUDA each worker allocates its cache on its own GPU and hands rank 0
CUDA IPC handles of it instead of a file (engine.parallel.kv_ipc).
"""
from __future__ import annotations

import mmap
import os

import torch

from engine.kv_cache import KVCacheSpec, torch_dtype

_PAGE = 4096


def kv_segment_path(segment: str, rank: int) -> str:
    return f"{segment}-kv{rank}"


def _layer_bytes(spec: KVCacheSpec, num_blocks: int) -> int:
    return -(-num_blocks * spec.bytes_per_block_per_layer // _PAGE) * _PAGE


def kv_cache_bytes(spec: KVCacheSpec, num_blocks: int) -> int:
    return spec.num_layers * _layer_bytes(spec, num_blocks)


def create_kv_segment(path: str, spec: KVCacheSpec, num_blocks: int, rank: int, prefault: bool = False) -> None:
    """A zeroed file for one rank's cache. Refused with the sizes named when /dev/shm cannot hold it
    (a write past its end would kill the rank with SIGBUS under load). ``prefault``: back every page now."""
    size = kv_cache_bytes(spec, num_blocks)
    st = os.statvfs(os.path.dirname(path))
    if size > st.f_bavail * st.f_frsize:
        raise RuntimeError(f"tensor-parallel rank {rank}: its KV cache needs {size / 2**20:.1f} MiB of "
                           f"{os.path.dirname(path)}, which has {st.f_bavail * st.f_frsize / 2**20:.1f} MiB free "
                           "(lower num_kv_blocks / kv_cache_memory_gb, or enlarge it)")
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        if prefault:
            os.posix_fallocate(fd, 0, size)
        else:
            os.ftruncate(fd, size)
    except OSError:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)


def map_kv_cache(path: str, spec: KVCacheSpec, num_blocks: int) -> list[torch.Tensor]:
    """The per-layer cache tensors of the file at `path` (shared mapping; the tensors keep it alive)."""
    fd = os.open(path, os.O_RDWR)
    try:
        mm = mmap.mmap(fd, kv_cache_bytes(spec, num_blocks), mmap.MAP_SHARED)
    finally:
        os.close(fd)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:  # honoured where tmpfs allows huge pages (shmem_enabled advise / within_size)
            mm.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    raw = torch.frombuffer(mm, dtype=torch.uint8)  # keeps `mm` alive
    per_layer, used = _layer_bytes(spec, num_blocks), num_blocks * spec.bytes_per_block_per_layer
    dtype = torch_dtype(spec.dtype)
    return [raw[i * per_layer:i * per_layer + used].view(dtype).view(num_blocks, *spec.block_shape)
            for i in range(spec.num_layers)]


def unlink_kv_segment(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
