"""Each worker rank's CUDA KV cache, shared with rank 0 as CUDA IPC handles (the CUDA
counterpart of engine.parallel.kv_shm).

A replica's one KV transfer endpoint runs in rank 0's process and reads (prefill)
or writes (decode) every rank's cache. On CUDA each worker allocates its cache on
its own GPU and, once it is built, exports every layer's tensor with torch's CUDA
IPC reduction (`export_kv`: a picklable rebuild function and its arguments per
layer, plus the GPU's UUID); the handles travel to rank 0 in the worker's `Ready`
message, and rank 0 opens them (`import_kv`), checking each layer's shape and
dtype against the rank's heads. The exporting process keeps the memory alive as
long as it runs; rank 0 drops its views (the group's teardown) before it stops
the workers.

A device index means nothing across processes that see their GPUs in different
orders (each Ray rank sees its own GPU first, as cuda:0, then the node's others:
engine.parallel.devices), so the handle names its GPU by UUID and rank 0 opens it
on its own index of that GPU; a GPU that rank 0 cannot see (a process started
with a narrower CUDA_VISIBLE_DEVICES) is refused with both named. The same code exports and rebuilds CPU tensors (shared memory),
which is how its pure-Python part is tested without a GPU.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

_STORAGE_DEVICE = 6  # the storage's device index among rebuild_cuda_tensor's arguments


@dataclass(frozen=True)
class SharedKV:
    """One rank's per-layer KV cache, as another process on the host rebuilds it."""

    rank: int
    device_uuid: str  # the GPU that holds it ("" for a CPU cache)
    layers: list  # per layer: (rebuild function, its arguments), torch.multiprocessing.reductions
    shape: tuple[int, ...]  # every layer's: [num_blocks, 2, block_size, this rank's heads, head_dim]
    dtype: str


def device_uuid(device: torch.device | str) -> str:
    device = torch.device(device)
    if device.type != "cuda":
        return ""
    return str(torch.cuda.get_device_properties(device).uuid)


def visible_uuids() -> list[str]:
    """This process's CUDA devices' UUIDs, by index."""
    if not torch.cuda.is_available():
        return []
    return [device_uuid(f"cuda:{i}") for i in range(torch.cuda.device_count())]


def export_kv(rank: int, kv_caches: list[torch.Tensor]) -> SharedKV:
    """The handles of this rank's cache (the tensors must outlive every importer's use)."""
    from torch.multiprocessing.reductions import reduce_tensor

    from engine.kv_cache import dtype_name

    first = kv_caches[0]
    return SharedKV(rank, device_uuid(first.device), [reduce_tensor(t) for t in kv_caches],
                    tuple(first.shape), dtype_name(first.dtype))


def local_index(shared: SharedKV, uuids: list[str]) -> int:
    """This process's index of the GPU that holds ``shared`` (``uuids``: `visible_uuids`)."""
    if shared.device_uuid in uuids:
        return uuids.index(shared.device_uuid)
    raise RuntimeError(f"tensor-parallel rank {shared.rank}'s KV cache is on GPU {shared.device_uuid}, which rank 0 "
                       f"does not see (it sees {uuids or 'no GPU'}): the KV transfer endpoint on rank 0 needs every "
                       "rank's GPU visible to its process")


def on_device(args: tuple, index: int) -> tuple:
    """rebuild_cuda_tensor's arguments with the storage opened on this process's device ``index``."""
    return args[:_STORAGE_DEVICE] + (index,) + args[_STORAGE_DEVICE + 1:]


def import_kv(shared: SharedKV, shape: tuple[int, ...], dtype: str, num_layers: int,
              uuids: list[str] | None = None) -> list[torch.Tensor]:
    """Rank 0's views of ``shared`` (one tensor per layer, aliasing the worker's cache), checked
    against what that rank's cache must be: ``num_layers`` layers of ``shape`` and ``dtype``."""
    if len(shared.layers) != num_layers or tuple(shared.shape) != tuple(shape) or shared.dtype != dtype:
        raise RuntimeError(f"tensor-parallel rank {shared.rank} shared a KV cache of {len(shared.layers)} layers of "
                           f"{list(shared.shape)} {shared.dtype}; rank 0 expects {num_layers} of {list(shape)} {dtype}")
    index = local_index(shared, visible_uuids() if uuids is None else uuids) if shared.device_uuid else None
    out = []
    for rebuild, args in shared.layers:
        t = rebuild(*(on_device(args, index) if index is not None else args))
        if tuple(t.shape) != tuple(shape):
            raise RuntimeError(f"tensor-parallel rank {shared.rank}: a rebuilt KV layer is {list(t.shape)}, "
                               f"not {list(shape)}")
        out.append(t)
    return out
