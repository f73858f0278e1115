"""The spec's tensor-parallel fields: what reaches the engine and the launcher, and the
refusals (a strategy that may spread the ranks, GPUs, a TP that does not split the model's
heads), each naming its field; disaggregated stages may differ in TP."""
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
