"""The spec's tensor-parallel fields: what reaches the engine and the launcher, and the
refusals (a strategy that may spread the ranks, GPUs, a TP that does not split the model's
heads), each naming its field; disaggregated stages may differ in TP."""
from pathlib import Path

import pytest

from cluster.cli import main
from cluster.spec import Spec, SpecError, split_spec
from cluster.types import Stage
from tests.engine.factories import save_tiny_model


def colocated(**stage) -> dict:
    return {"mode": "colocated", "colocated": stage}


def test_tp_reaches_the_engine_and_the_launcher():
    cfg = split_spec(Spec.model_validate(colocated(tensor_parallel_size=2, tp_backend="gloo", tp_timeout_s=5.0,
                                                   placement_strategy="PACK", placement_timeout_s=7.0,
                                                   resources={"num_cpus": 2})))
    sc = cfg.stages[Stage.COLOCATED]
    assert sc.tensor_parallel_size == 2 and sc.placement_strategy == "PACK" and sc.placement_timeout_s == 7.0
    assert sc.ray_options["num_cpus"] == 2  # per rank
    e = sc.engine
    assert (e.tensor_parallel_size, e.tp_backend, e.tp_timeout_s) == (2, "gloo", 5.0)
    assert split_spec(Spec.model_validate({})).stages[Stage.PREFILL].placement_strategy == "STRICT_PACK"


@pytest.mark.parametrize("stage, problem", [
    ({"tensor_parallel_size": 2, "placement_strategy": "SPREAD"},
     "colocated.placement_strategy: SPREAD may put the 2 ranks on different hosts"),
    ({"tensor_parallel_size": 4, "placement_strategy": "STRICT_SPREAD"},
     "colocated.placement_strategy: STRICT_SPREAD may put the 4 ranks on different hosts"),
    ({"placement_strategy": "RANDOM"}, "colocated.placement_strategy: must be one of"),
    ({"tp_backend": "rdma"}, "colocated.tp_backend: must be one of"),
    ({"tp_backend": "nccl"}, "tp_backend: nccl needs device: cuda"),
    ({"tensor_parallel_size": 2, "tp_backend": "shm", "resources": {"num_gpus": 1}},
     "tp_backend: shm sums host memory and the replica is on GPUs"),
    ({"tensor_parallel_size": 2, "resources": {"num_gpus": 0.5}}, "each rank needs a GPU of its own"),
    ({"pipeline_parallel_size": 2, "tp_backend": "gloo", "resources": {"num_gpus": 1}},
     "tp_backend: gloo hands the stages' activations on through host memory and the replica is on GPUs"),
    ({"tp_timeout_s": 0}, "colocated.tp_timeout_s: must be > 0"),
])
def test_tp_fields_refused_with_their_path(stage, problem):
    with pytest.raises(SpecError) as e:
        Spec.model_validate(colocated(**stage))
    assert problem in str(e.value)


def test_a_gpu_tp_replica_runs_nccl_on_cuda_with_a_gpu_per_rank():
    cfg = split_spec(Spec.model_validate(colocated(tensor_parallel_size=2, resources={"num_gpus": 1})))
    stage = cfg.stages[Stage.COLOCATED]
    e = stage.engine
    assert (e.device, e.tensor_parallel_size, e.tp_comm_backend) == ("cuda", 2, "nccl")
    assert stage.ray_options["num_gpus"] == 1  # per rank: each rank's bundle asks for its own GPU


@pytest.mark.parametrize("backend, gpus, want", [("gloo", 0, "gloo"), ("shm", 0, "shm"), ("auto", 1, "nccl")])
def test_a_pipeline_parallel_replica_runs_on_each_backend_that_fits(backend, gpus, want):
    cfg = split_spec(Spec.model_validate(colocated(pipeline_parallel_size=2, tp_backend=backend,
                                                   resources={"num_gpus": gpus})))
    e = cfg.stages[Stage.COLOCATED].engine
    assert (e.pipeline_parallel_size, e.tp_comm_backend) == (2, want)
    e.validate()


def test_spread_is_fine_for_a_single_rank():
    Spec.model_validate(colocated(placement_strategy="SPREAD"))


@pytest.mark.parametrize("prefill, decode", [(1, 2), (2, 1), (2, 2), (3, 1)])
def test_disaggregated_stages_may_differ_in_tp(prefill, decode):
    """The KV transfer reshards the heads between the two layouts (kvtransfer.reshard)."""
    cfg = split_spec(Spec.model_validate({"prefill": {"tensor_parallel_size": prefill},
                                          "decode": {"tensor_parallel_size": decode}}))
    assert (cfg.stages[Stage.PREFILL].tensor_parallel_size, cfg.stages[Stage.DECODE].tensor_parallel_size) == \
        (prefill, decode)


def test_validate_checks_tp_against_the_models_heads(tmp_path, capsys):
    save_tiny_model(tmp_path / "m")  # 4 heads, 2 KV heads, intermediate 64
    spec = tmp_path / "s.yaml"
    spec.write_text(f"model: {tmp_path / 'm'}\nmode: colocated\ncolocated: {{tensor_parallel_size: 3}}\n")
    assert main(["validate", str(spec)]) == 1
    assert "colocated.tensor_parallel_size: 3 does not divide the model's num_attention_heads (4)" \
        in capsys.readouterr().err
    spec.write_text(f"model: {tmp_path / 'm'}\nmode: colocated\ncolocated: {{tensor_parallel_size: 2}}\n")
    assert main(["validate", str(spec)]) == 0


# ---- pipeline parallelism ------------------------------------------------------------------------------
@pytest.mark.parametrize("section", ["prefill", "decode", "colocated"])
def test_pp_fields_are_in_every_stage_spec(section):
    spec = {"mode": "colocated"} if section == "colocated" else {}
    stage = {"pipeline_parallel_size": 1, "pipeline_layer_split": [30]}
    if section != "decode":
        stage = {"pipeline_parallel_size": 2, "pipeline_layer_split": [10, 20], "tensor_parallel_size": 2}
    s = getattr(Spec.model_validate({**spec, section: stage}), section)
    assert (s.pipeline_parallel_size, s.pipeline_layer_split) == (stage["pipeline_parallel_size"],
                                                                  stage["pipeline_layer_split"])
    assert s.num_ranks == stage["pipeline_parallel_size"] * stage.get("tensor_parallel_size", 1)


def test_pp_reaches_the_engine_and_the_launcher():
    """The launcher's placement group gets one bundle per rank: pp x tp; the engine gets the split."""
    from engine.config import ConfigError

    spec = Spec.model_validate(colocated(pipeline_parallel_size=1, pipeline_layer_split=[30]))
    assert split_spec(spec).stages[Stage.COLOCATED].engine.pipeline_layer_split == (30,)
    spec = Spec.model_validate(colocated(pipeline_parallel_size=2, pipeline_layer_split=[10, 20],
                                         tensor_parallel_size=2, resources={"num_cpus": 1}))
    try:
        sc = split_spec(spec).stages[Stage.COLOCATED]
    except ConfigError as e:  # main before the pipeline runner: EngineConfig still refuses pp > 1
        assert "pipeline_parallel_size: 2 is not supported yet" in str(e)
        sc = None
    if sc is not None:
        assert (sc.num_ranks, sc.pipeline_parallel_size, sc.pipeline_layer_split) == (4, 2, (10, 20))
        assert (sc.engine.pipeline_parallel_size, sc.engine.pipeline_layer_split) == (2, (10, 20))
        assert sc.ray_options["num_cpus"] == 1  # per rank
    assert spec.colocated.num_ranks == 4


@pytest.mark.parametrize("stage, problem", [
    ({"pipeline_parallel_size": 2, "pipeline_layer_split": [10, 10, 10]},
     "colocated.pipeline_layer_split: 3 counts for pipeline_parallel_size 2"),
    ({"pipeline_parallel_size": 2, "pipeline_layer_split": [10, 0]}, "colocated.pipeline_layer_split.1:"),
    ({"pipeline_parallel_size": 0}, "colocated.pipeline_parallel_size:"),
    ({"pipeline_parallel_size": 2, "placement_strategy": "SPREAD"},
     "colocated.placement_strategy: SPREAD may put the 2 ranks on different hosts"),
    ({"pipeline_parallel_size": 2, "tensor_parallel_size": 2, "placement_strategy": "STRICT_SPREAD"},
     "colocated.placement_strategy: STRICT_SPREAD may put the 4 ranks on different hosts"),
    ({"pipeline_parallel_size": 2, "resources": {"num_gpus": 0.5}},
     "pipeline_parallel_size 2 x tensor_parallel_size 1 with resources.num_gpus 0.5: each rank needs a GPU"),
])
def test_pp_fields_refused_with_their_path(stage, problem):
    with pytest.raises(SpecError) as e:
        Spec.model_validate(colocated(**stage))
    assert problem in str(e.value)


def test_a_decode_stage_with_pipeline_parallelism_is_refused_with_the_reason():
    with pytest.raises(SpecError) as e:
        Spec.model_validate({"prefill": {"pipeline_parallel_size": 2}, "decode": {"pipeline_parallel_size": 2}})
    assert "decode.pipeline_parallel_size: 2 refused, a decode replica runs one pipeline stage" in str(e.value)
    assert "tensor_parallel_size instead" in str(e.value)
    Spec.model_validate({"prefill": {"pipeline_parallel_size": 2}, "decode": {"tensor_parallel_size": 2}})


def test_validate_checks_the_layer_split_against_the_model(tmp_path, capsys):
    save_tiny_model(tmp_path / "m", num_hidden_layers=4)
    spec = tmp_path / "s.yaml"
    spec.write_text(f"model: {tmp_path / 'm'}\nprefill: {{pipeline_parallel_size: 2, pipeline_layer_split: [1, 2]}}\n")
    assert main(["validate", str(spec)]) == 1
    err = capsys.readouterr().err
    assert "prefill.pipeline_layer_split: [1, 2] sums to 3 layers; the model has 4" in err, err
    spec.write_text(f"model: {tmp_path / 'm'}\nmode: colocated\ncolocated: {{pipeline_parallel_size: 5}}\n")
    assert main(["validate", str(spec)]) == 1
    assert "colocated.pipeline_parallel_size: 5 stages for a model of 4 layers" in capsys.readouterr().err
    spec.write_text(f"model: {tmp_path / 'm'}\nprefill: {{pipeline_parallel_size: 2, pipeline_layer_split: [1, 3]}}\n")
    assert main(["validate", str(spec)]) == 0


def test_the_launcher_checks_the_split_with_every_problem_named(tmp_path):
    """What `serve` runs before Ray starts (check_fits_model over the launcher's StageConfigs)."""
    from cluster.spec_tp import check_fits_model
    from engine.weights import read_config

    save_tiny_model(tmp_path / "m", num_hidden_layers=4)
    cfg = split_spec(Spec.model_validate({"prefill": {"pipeline_parallel_size": 1, "pipeline_layer_split": [3],
                                                      "tensor_parallel_size": 3}}))
    with pytest.raises(SpecError) as e:
        check_fits_model(cfg.stages, read_config(tmp_path / "m"))
    assert e.value.problems[0].startswith("prefill.tensor_parallel_size: 3")
    assert e.value.problems[1] == "prefill.pipeline_layer_split: [3] sums to 3 layers; the model has 4"


def test_the_launcher_refuses_replicas_the_ray_cluster_cannot_hold_at_once():
    """What `serve` checks once Ray is up (check_fits_cluster): a replica the cluster cannot hold
    would otherwise wait for resources until the start times out, with no word of why."""
    from cluster.spec_tp import check_fits_cluster

    cfg = split_spec(Spec.model_validate({"prefill": {"pipeline_parallel_size": 2, "resources": {"num_cpus": 1}},
                                          "decode": {"resources": {"num_cpus": 1}}}))
    with pytest.raises(SpecError) as e:
        check_fits_cluster(cfg.stages, {"CPU": 2.0, "memory": 1e9})
    assert e.value.problems == [
        "resources: the stages ask for 3 CPU in all (prefill 1 x 2 rank(s) x 1, decode 1 x 1 rank(s) x 1) and the "
        "Ray cluster has 2; lower a stage's replicas or its resources per rank (fractions such as num_cpus: 0.5 "
        "share a core)"]
    check_fits_cluster(cfg.stages, {"CPU": 3.0})
    # one pipeline-parallel replica alone too big: left to its placement, which names its bundles
    check_fits_cluster(cfg.stages, {"CPU": 1.0})
    gpu = split_spec(Spec.model_validate({"prefill": {"tensor_parallel_size": 4, "resources": {"num_gpus": 1}},
                                          "decode": {"replicas": 2, "resources": {"num_gpus": 1,
                                                                                  "custom": {"decode_node": 1}}}}))
    with pytest.raises(SpecError) as e:
        check_fits_cluster(gpu.stages, {"CPU": 64.0, "GPU": 4.0})
    assert [p.split(" in all")[0] for p in e.value.problems] == [
        "resources: the stages ask for 6 GPU", "resources: the stages ask for 2 decode_node"]


@pytest.mark.parametrize("path", sorted((Path(__file__).resolve().parents[2] / "deploy").glob("*.yaml")),
                         ids=lambda p: p.name)
def test_every_cpu_spec_in_deploy_fits_a_two_core_machine(path, monkeypatch):
    """`kvrelay serve deploy/<spec>.yaml` on a 2-core laptop (or CI): every CPU-only spec's replicas
    fit its local Ray instance at once."""
    import yaml

    from cluster.spec import load_spec
    from cluster.spec_tp import check_fits_cluster

    if "apiVersion" in (yaml.safe_load(path.read_text()) or {}):
        pytest.skip("a Kubernetes manifest")
    monkeypatch.setenv("KVRELAY_API_KEYS", "k")
    monkeypatch.setenv("KVRELAY_CLUSTER_SECRET", "s")
    stages = split_spec(load_spec(path)).stages
    if any(sc.ray_options.get("num_gpus") or sc.ray_options.get("resources") for sc in stages.values()):
        pytest.skip("a GPU or multi-node spec")
    check_fits_cluster(stages, {"CPU": 2.0})
