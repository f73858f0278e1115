"""The kernel build cache: a build killed mid-way (its torch lock file left behind) does not
make the next start wait for ever, and every checkout with the same sources and the same
torch installation shares one build (compiled from copies of the sources inside the build
folder), while another environment gets a folder of its own."""
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


def test_another_torch_installation_builds_in_a_folder_of_its_own(monkeypatch, tmp_path):
    """build.ninja names the torch headers' folder: two virtualenvs sharing one build folder would
    rebuild it over each other on every load (minutes each), so the folder is keyed by it too."""
    monkeypatch.setenv("KVRELAY_CACHE_DIR", str(tmp_path))
    here = kernels._build_dir("avx2")
    fake = tmp_path / "other-venv" / "torch"
    fake.mkdir(parents=True)
    monkeypatch.setattr(kernels.torch, "__file__", str(fake / "__init__.py"))
    there = kernels._build_dir("avx2")
    assert here != there and here.name == there.name == "avx2"
    assert here.parent.name.rsplit("-", 1)[0] == there.parent.name.rsplit("-", 1)[0]  # same torch version
