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


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` run only where CUDA is available."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
