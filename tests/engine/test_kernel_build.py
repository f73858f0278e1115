"""The kernel build cache: a build killed mid-way (its torch lock file left behind) does not
make the next start wait for ever, and every checkout with the same sources shares one
build (compiled from copies of the sources inside the build folder)."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from engine import kernels

LOAD = "import sys; from engine import kernels; sys.exit(0 if kernels.load_native_ops({isa!r}) is not None else 3)"


@pytest.mark.parametrize("isa", ["avx2"])
def test_a_stale_build_lock_is_removed_not_waited_on(isa):
    if isa not in kernels.cpu_isas():
        pytest.skip(f"this CPU lacks {isa}")
    d = kernels._build_dir(isa)
    if kernels.load_native_ops(isa) is None:
        pytest.skip("no compiler here: the torch path runs")
    (d / "lock").write_text("")  # what a build killed by SIGKILL leaves (torch's FileBaton)
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-c", LOAD.format(isa=isa)], timeout=300, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert not (d / "lock").exists()
    assert time.monotonic() - t0 < 120  # loaded from the cache, not waited on (torch would wait for ever)
    # the build compiles copies of the sources in its own folder: other checkouts write the same build.ninja
    ninja = (d / "build.ninja").read_text()
    assert str(d / "src") in ninja and str(kernels._CSRC) not in ninja
