"""Fixtures shared by every test package."""
from __future__ import annotations

from pathlib import Path

import pytest

from engine.weights import resolve_model


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The default model (SmolLM2-135M-Instruct) as a checkpoint folder.

    Converted from the packaged GGUF on first use and cached like any worker
    would ($KVRELAY_CACHE_DIR or ~/.cache/kvrelay), so later runs take about a second.
    """
    return resolve_model(None)


@pytest.fixture(scope="session")
def ray_instance():
    """One real local Ray instance for the whole session (the e2e and chaos suites share it)."""
    import ray

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    yield ray
    ray.shutdown()


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` run only where CUDA is available."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
