import re
from pathlib import Path

import pytest
import yaml

from cluster.spec import load_spec, split_spec
from cluster.types import Stage

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
ALL_YAML = sorted(DEPLOY.glob("*.yaml"))
SPECS = [p for p in ALL_YAML if "apiVersion" not in (yaml.safe_load(p.read_text()) or {})]


def test_the_expected_files_exist():
    names = {p.name for p in ALL_YAML}
    assert {"local.yaml", "colocated.yaml", "multi-gpu.yaml", "multi-node.yaml", "kuberay-rayjob.yaml"} <= names
    assert (DEPLOY / "README.md").exists()


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.name)
def test_every_spec_validates(path, monkeypatch):
    spec = load_spec(path)
    monkeypatch.setenv("KVRELAY_API_KEYS", "k1,k2")
    monkeypatch.setenv("KVRELAY_CLUSTER_SECRET", "s")
    cfg = split_spec(spec)
    for stage in cfg.stages.values():
        stage.engine.validate()


def test_local_is_the_small_cpu_default():
    spec = load_spec(DEPLOY / "local.yaml")
    assert spec.model == "SmolLM2-135M-Instruct" and spec.mode == "disaggregated"
    assert spec.transfer.backend == "grpc" and spec.router.policy == "least_loaded"
    assert all(s.replicas == 1 and s.resources.num_gpus == 0 for s in spec.stages().values())
    assert set(spec.stages()) == {Stage.PREFILL, Stage.DECODE}


def test_rayjob_runs_a_spec_that_exists():
    manifest = yaml.safe_load((DEPLOY / "kuberay-rayjob.yaml").read_text())
    assert manifest["kind"] == "RayJob" and manifest["apiVersion"].startswith("ray.io/")
    entrypoint = manifest["spec"]["entrypoint"]
    match = re.search(r"kvrelay serve (\S+\.yaml)", entrypoint)
    assert match, entrypoint
    spec_path = DEPLOY.parent / match.group(1)
    assert spec_path.exists()
    load_spec(spec_path)
    # The custom resources the spec asks for are ones the worker groups offer.
    offered = "".join(g["rayStartParams"].get("resources", "") for g in manifest["spec"]["rayClusterSpec"]["workerGroupSpecs"])
    for stage in load_spec(spec_path).stages().values():
        for name in stage.resources.custom:
            assert name in offered
