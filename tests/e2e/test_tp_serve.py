"""`kvrelay serve` of a tensor-parallel spec whose placement group no node can hold: it exits 1
at start, fast, naming the stage, the bundles and what the cluster has (on its own local Ray
instance, as a user runs it)."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from tests.engine.factories import save_tiny_model_with_tokenizer

REPO = Path(__file__).resolve().parents[2]


def test_serve_fails_fast_when_the_placement_cannot_be_met(tmp_path, default_model_dir):
    (tmp_path / "m").mkdir()
    save_tiny_model_with_tokenizer(tmp_path / "m", default_model_dir)
    spec = tmp_path / "tp.yaml"
    spec.write_text(f"model: {tmp_path / 'm'}\nmode: colocated\ndtype: float32\n"
                    "colocated: {replicas: 1, tensor_parallel_size: 2, resources: {num_cpus: 64}}\n"
                    "transfer: {backend: local}\nfrontend: {grpc_port: 0, http_port: 0}\n")
    t0 = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "cluster", "serve", str(spec)], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    took = time.monotonic() - t0
    assert run.returncode == 1, run.stdout + run.stderr
    assert "kvrelay: failed to start: PlacementError: colocated: a tensor-parallel replica asks for 2 bundles of " \
           "{'CPU': 64.0} (STRICT_PACK): no node has CPU 128 in all; the cluster has CPU " in run.stderr, run.stderr
    assert took < 60, took  # Ray's own start is most of it; the placement is refused at once
