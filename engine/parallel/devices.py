"""Which device each tensor-parallel rank runs on: one function for both ways ranks are started.

- Offline (`engine.LLM(device="cuda", tensor_parallel_size=N)`): rank 0 spawns the others, and
  every process sees every GPU of the host, so rank r takes ``cuda:r``.
- In the cluster each rank is a Ray actor whose bundle asks for its own ``num_gpus``; Ray sets
  each actor's CUDA_VISIBLE_DEVICES to its GPU, so every rank takes ``cuda:0`` of what it sees
  (``is_isolated``).

CPU ranks all run on ``cpu``. Imports no torch: the caller passes the device count it sees.
"""
from __future__ import annotations

from engine.config import ConfigError


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


def cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
