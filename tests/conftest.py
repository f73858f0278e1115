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


# ---- CPU kernel ISA paths ------------------------------------------------------
# Tests of the native kernels take `kernel_isa` (or call require_isa): they run once
# per ISA build (engine.kernels.ISAS) and skip only where this CPU lacks that ISA.
# The AVX2 build runs on AVX-512 machines too, so every CI machine exercises it.
# Kernel families: "bf16" (packed bf16 weights, bf16 activations) and "quant"
# (quantized weights, Q8_0 / Q4_1 / int8, fp32 activations: tests/engine/test_quant_*).
KERNEL_FAMILIES = ("bf16", "quant")
_exercised: dict[str, set[str]] = {f: set() for f in KERNEL_FAMILIES}


def _isa_names():
    from engine.kernels import ISA_NAMES

    return ISA_NAMES


def require_isa(isa: str, family: str = "bf16") -> str:
    """Skip the calling test where this CPU lacks `isa`; else count `family` on it as exercised."""
    from engine.kernels import cpu_isas

    if isa not in cpu_isas():
        pytest.skip(f"CPU lacks {isa}")
    _exercised[family].add(isa)
    return isa


@pytest.fixture(scope="session", params=_isa_names())
def kernel_isa(request) -> str:
    """A native kernel ISA path (engine.kernels.ISA_NAMES) this CPU runs."""
    return require_isa(request.param)


def pytest_terminal_summary(terminalreporter):
    """Which kernel families, on which ISA paths, this run exercised: `make test` names them."""
    from engine.kernels import cpu_isas

    ran = [f"{f} on {', '.join(n for n in _isa_names() if n in _exercised[f]) or 'none'}"
           for f in KERNEL_FAMILIES]
    terminalreporter.write_line(f"kernel families exercised: {'; '.join(ran)} "
                                f"(this CPU runs: {', '.join(cpu_isas()) or 'none'})")
