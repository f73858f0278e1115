"""Fixtures shared by the engine's kernel tests."""
from __future__ import annotations

import pytest

from engine.kernels import NativeOps, load_native_ops


@pytest.fixture(scope="session")
def native(kernel_isa):
    """The native bf16 ops of one kernel ISA path (tests/conftest.py's kernel_isa): a test that
    takes it runs once per path this CPU runs."""
    ext = load_native_ops(kernel_isa)
    assert ext is not None, f"the {kernel_isa} kernels should build on a CPU that runs {kernel_isa}"
    assert ext.isa == kernel_isa
    return NativeOps(ext)
