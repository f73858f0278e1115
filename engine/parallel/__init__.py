"""Tensor and pipeline parallelism inside one engine: the sharding plan (sharding.py), the
collectives (comm.py, shm.py), the hand-offs between pipeline stages (pipe.py), the
per-step message to the other ranks (step.py), the worker processes (worker.py, group.py,
launch.py) and rank 0's runner (runner.py).

`start_engine` is the entry point: an EngineCore whose model is rank 0's shard, with
ranks 1..N-1 in worker processes of their own.
"""
from __future__ import annotations

from pathlib import Path


def start_engine(model_dir: str | Path, config, launcher=None):
    """EngineCore for `config` (tensor_parallel_size or pipeline_parallel_size > 1) over the checkpoint folder
    `model_dir`: ranks 1..N-1 are started by `launcher` (engine.parallel.launch; default:
    spawned children) and load their shards while rank 0 loads its own."""
    import torch

    from engine.core import EngineCore
    from engine.parallel.group import TPGroup
    from engine.parallel.sharding import ShardLayout, check_tensor_parallel, load_shard, pipeline_layers
    from engine.weights import read_config

    config.validate()
    model_config = read_config(model_dir)
    check_tensor_parallel(model_config, config.tensor_parallel_size, config.enable_expert_parallel)
    pipeline_layers(model_config.num_layers, config.pipeline_parallel_size, config.pipeline_layer_split)
    group = TPGroup(str(model_dir), config, model_config, launcher)
    try:
        _, weights = load_shard(model_dir, ShardLayout.for_engine(model_config, 0, config),
                                torch.float32)
        return EngineCore(model_config, weights, config, tp_group=group)
    except BaseException:
        group.close()
        raise
