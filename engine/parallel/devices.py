"""Which device each tensor-parallel rank runs on: one function for both ways ranks are started.

- Offline (`engine.LLM(device="cuda", tensor_parallel_size=N)`): rank 0 spawns the others, and
  every process sees every GPU of the host, so rank r takes ``cuda:r``.
- In the cluster each rank is a Ray actor whose bundle asks for its own ``num_gpus``. Ray is told
  not to narrow the actor's CUDA_VISIBLE_DEVICES to its GPU (rank 0, the replica's KV endpoint,
  must open every rank's cache through CUDA IPC); instead each rank, in its own process and before
  CUDA starts, sets it to its bundle's GPU first and then every other GPU of the node
  (`replica_visible_devices`, from ``ray.get_gpu_ids()``). So every rank still takes ``cuda:0``
  (``is_isolated``: "cuda" means the rank's own GPU in every thread), NCCL gets one device per
  rank, and rank 0 sees the other ranks' GPUs (kv_ipc names them by UUID, not index).

CPU ranks all run on ``cpu``. Imports no torch: the caller passes the device count it sees.
"""
from __future__ import annotations

from engine.config import ConfigError

VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"


def rank_device(device: str, rank: int, size: int, num_visible: int, is_isolated: bool) -> str:
    """The torch device of rank ``rank`` of ``size`` for the engine's ``device`` ("cpu" or "cuda"),
    where this process sees ``num_visible`` GPUs. Raises ConfigError where the GPUs do not suffice."""
    if not device.startswith("cuda"):
        return device
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is not a rank of a group of {size}")
    if is_isolated:
        if num_visible < 1:
            raise ConfigError(f"tensor-parallel rank {rank}: device cuda, but this process sees no GPU "
                              "(its Ray bundle needs resources.num_gpus >= 1)")
        return "cuda:0"
    if size > num_visible:
        raise ConfigError(f"tensor_parallel_size: {size} ranks need {size} GPUs (one each) and this host "
                          f"sees {num_visible}")
    return f"cuda:{rank}"


def parse_visible(value: str | None) -> list[str] | None:
    """CUDA_VISIBLE_DEVICES as a list of its entries (indices or UUIDs); None where it is not set."""
    if value is None:
        return None
    if value.strip() in ("", "NoDevFiles"):
        return []
    return [v.strip() for v in value.split(",")]


def replica_visible_devices(rank: int, own_ids: list, node_visible: str | None, num_node_gpus: int) -> str:
    """CUDA_VISIBLE_DEVICES for rank ``rank`` of a Ray replica: its own GPU(s) first (so it runs on
    ``cuda:0``), then every other GPU of the node (so rank 0 can open each rank's cache).

    own_ids: ``ray.get_gpu_ids()`` in the rank's actor (entries of ``node_visible`` where the node's
    Ray started under a CUDA_VISIBLE_DEVICES, else indices); node_visible: CUDA_VISIBLE_DEVICES as
    the actor inherited it (Ray told not to set it); num_node_gpus: the node's GPUs (used where
    ``node_visible`` is not set). Raises ConfigError naming the ids where they do not fit."""
    own = sorted({str(i) for i in own_ids}, key=lambda s: (not s.isdigit(), int(s) if s.isdigit() else 0, s))
    if not own:
        raise ConfigError(f"tensor-parallel rank {rank}: device cuda, but its Ray bundle holds no GPU "
                          "(resources.num_gpus >= 1 per rank)")
    node = parse_visible(node_visible)
    if node is None:
        node = [str(i) for i in range(num_node_gpus)]
    missing = [i for i in own if i not in node]
    if missing:
        raise ConfigError(f"tensor-parallel rank {rank}: Ray gave it GPU {', '.join(missing)}, which is not "
                          f"among the node's GPUs {node or '(none)'}")
    return ",".join(own + [i for i in node if i not in own])


def cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
