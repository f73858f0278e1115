"""Fixtures shared by the engine's kernel tests."""
from __future__ import annotations

import pytest

from engine.kernels import ISA_NAMES, NativeOps, load_native_ops
from tests.conftest import require_isa


@pytest.fixture(scope="session")
def native(kernel_isa):
    """The native bf16 ops of one kernel ISA path (tests/conftest.py's kernel_isa): a test that
    takes it runs once per path this CPU runs."""
    ext = load_native_ops(kernel_isa)
    assert ext is not None, f"the {kernel_isa} kernels should build on a CPU that runs {kernel_isa}"
    assert ext.isa == kernel_isa
    return NativeOps(ext)


@pytest.fixture(scope="module", params=ISA_NAMES)
def quant_isa(request) -> str:
    """A kernel ISA path (engine.kernels.ISA_NAMES) this CPU runs, for a model with quantized
    weights: a test that takes it runs once per path and counts the quant family on it."""
    return require_isa(request.param, family="quant")
