"""The CUDA path of tensor parallelism, as far as it runs without a GPU: the backend choice and its
refusals, the device each rank takes, the NCCL and gloo collectives sharing one implementation, and
the KV cache export/rebuild that rank 0 uses to reach every rank's cache (exercised here on CPU
shared memory across two real processes; tests/gpu/test_tp_cuda.py runs it on GPUs)."""
from __future__ import annotations

import multiprocessing as mp
import os

import pytest
import torch

from engine.config import ConfigError, EngineConfig
from engine.llm import LLM
from engine.parallel import comm
from engine.parallel.devices import rank_device, replica_visible_devices
from engine.parallel.kv_ipc import SharedKV, export_kv, import_kv, local_index, on_device
from tests.engine.factories import save_tiny_model


@pytest.mark.parametrize("device, backend, want", [
    ("cpu", "auto", "shm"), ("cuda", "auto", "nccl"), ("cpu", "gloo", "gloo"), ("cuda", "nccl", "nccl"),
])
def test_auto_is_shm_on_cpu_and_nccl_on_cuda(device, backend, want):
    config = EngineConfig(device=device, tp_backend=backend, tensor_parallel_size=2)
    config.validate()
    assert config.tp_comm_backend == want


@pytest.mark.parametrize("fields, problem", [
    ({"tp_backend": "nccl"}, "tp_backend: nccl needs device: cuda"),
    ({"tp_backend": "shm", "device": "cuda", "tensor_parallel_size": 2}, "tp_backend: shm sums host memory"),
    ({"tp_backend": "gloo", "device": "cuda", "tensor_parallel_size": 2}, "tp_backend: gloo sums host memory"),
    ({"device": "cuda:1", "tensor_parallel_size": 2}, "device: give 'cuda' at tensor_parallel_size 2"),
    ({"tp_backend": "gloo", "device": "cuda", "pipeline_parallel_size": 2},
     "tp_backend: gloo hands the stages' activations on through host memory .* use nccl"),
    ({"tp_backend": "shm", "device": "cuda", "pipeline_parallel_size": 2}, "tp_backend: shm hands the stages'"),
    ({"tp_backend": "nccl", "pipeline_parallel_size": 2}, "tp_backend: nccl needs device: cuda"),
    ({"device": "cuda:1", "pipeline_parallel_size": 2}, "device: give 'cpu' or 'cuda' at pipeline_parallel_size 2"),
])
def test_a_backend_that_does_not_fit_the_device_is_refused(fields, problem):
    with pytest.raises(ConfigError, match=problem):
        EngineConfig(**fields).validate()


@pytest.mark.parametrize("device, backend, want", [
    ("cpu", "auto", "shm"), ("cpu", "shm", "shm"), ("cpu", "gloo", "gloo"), ("cuda", "auto", "nccl"),
    ("cuda", "nccl", "nccl"),
])
def test_pipeline_parallelism_runs_on_each_backend_that_fits_the_device(device, backend, want):
    config = EngineConfig(device=device, tp_backend=backend, pipeline_parallel_size=2, tensor_parallel_size=2)
    config.validate()
    assert config.tp_comm_backend == want


def test_llm_refuses_nccl_on_cpu_before_starting_a_rank(tmp_path):
    save_tiny_model(tmp_path, "llama")
    with pytest.raises(ConfigError, match="tp_backend: nccl needs device: cuda"):
        LLM(str(tmp_path), tensor_parallel_size=2, tp_backend="nccl")


def test_offline_rank_r_takes_cuda_r():
    assert [rank_device("cuda", r, 4, 8, is_isolated=False) for r in range(4)] == [f"cuda:{r}" for r in range(4)]


def test_a_ray_rank_takes_the_one_gpu_it_sees():
    assert [rank_device("cuda", r, 4, 1, is_isolated=True) for r in range(4)] == ["cuda:0"] * 4


def test_cpu_ranks_stay_on_cpu():
    assert rank_device("cpu", 1, 2, 0, is_isolated=False) == "cpu"


def test_more_ranks_than_gpus_is_refused_naming_both():
    with pytest.raises(ConfigError, match="3 ranks need 3 GPUs .* this host sees 2"):
        rank_device("cuda", 0, 3, 2, is_isolated=False)


def test_a_ray_rank_without_a_gpu_is_refused():
    with pytest.raises(ConfigError, match="rank 1: device cuda, but this process sees no GPU"):
        rank_device("cuda", 1, 2, 0, is_isolated=True)


# A Ray replica of 4 ranks on an 8-GPU node, Ray told not to set CUDA_VISIBLE_DEVICES: each rank sees its
# bundle's GPU first (its cuda:0) and then the node's others, so rank 0 sees every rank's GPU.
@pytest.mark.parametrize("node_visible, num_node_gpus, own, want", [
    (None, 8, [[2], [3], [4], [5]], ["2,0,1,3,4,5,6,7", "3,0,1,2,4,5,6,7", "4,0,1,2,3,5,6,7", "5,0,1,2,3,4,6,7"]),
    # the node's Ray started under CUDA_VISIBLE_DEVICES: ray.get_gpu_ids() gives its entries, as strings
    ("4,5,6,7", 4, [["6"], ["7"], ["4"], ["5"]], ["6,4,5,7", "7,4,5,6", "4,5,6,7", "5,4,6,7"]),
    ("GPU-a,GPU-b", 2, [["GPU-b"], ["GPU-a"]], ["GPU-b,GPU-a", "GPU-a,GPU-b"]),
    (None, 4, [[1, 0], [3, 2]], ["0,1,2,3", "2,3,0,1"]),  # num_gpus 2 a rank: the lowest id is its cuda:0
])
def test_a_ray_rank_sees_its_gpu_first_then_the_nodes(node_visible, num_node_gpus, own, want):
    got = [replica_visible_devices(rank, ids, node_visible, num_node_gpus) for rank, ids in enumerate(own)]
    assert got == want
    firsts = [g.split(",")[0] for g in got]
    assert len(set(firsts)) == len(firsts)  # one device per rank for NCCL
    mine = {str(i) for ids in own for i in ids}
    assert all(mine <= set(g.split(",")) for g in got)  # every rank's GPU visible to rank 0 (and the others)
    assert [rank_device("cuda", r, len(own), len(g.split(",")), is_isolated=True) for r, g in enumerate(got)] == \
        ["cuda:0"] * len(own)


def test_a_ray_rank_without_a_gpu_id_is_refused():
    with pytest.raises(ConfigError, match="rank 1: device cuda, but its Ray bundle holds no GPU"):
        replica_visible_devices(1, [], None, 8)


def test_a_gpu_id_that_is_not_the_nodes_is_refused_naming_both():
    with pytest.raises(ConfigError, match=r"rank 2: Ray gave it GPU 3, which is not among the node's GPUs \['0', '1'\]"):
        replica_visible_devices(2, [3], "0,1", 2)
    with pytest.raises(ConfigError, match=r"GPU 0, which is not among the node's GPUs \(none\)"):
        replica_visible_devices(0, [0], "", 0)


def test_nccl_and_gloo_share_one_implementation():
    for cls in (comm.GlooCollectives, comm.NcclCollectives):
        assert issubclass(cls, comm._DistCollectives)
        assert "all_reduce" not in vars(cls) and "gather_vocab" not in vars(cls)
    assert (comm.GlooCollectives.backend, comm.NcclCollectives.backend) == ("gloo", "nccl")
    with pytest.raises(ValueError, match="tp_backend 'shm'"):
        comm.dist_collectives("shm", 0, 1, "tcp://127.0.0.1:1", 1.0, "cpu")


# --- the KV cache shared with rank 0 ---------------------------------------------------------------

def _exporter(conn) -> None:
    """A worker: a 2-layer cache, exported; then it reads back what the importer wrote, and writes."""
    caches = [torch.zeros(4, 2, 16, 1, 8) for _ in range(2)]
    conn.send(export_kv(1, caches))
    conn.recv()  # the importer wrote
    conn.send([float(t[3, 1, 5, 0, 7]) for t in caches])
    caches[1][0].fill_(2.5)
    conn.send("written")
    conn.recv()  # hold the cache until the importer is done


def test_an_exported_cache_rebuilt_in_another_process_aliases_it():
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_exporter, args=(child,), daemon=True)
    p.start()
    try:
        shared = parent.recv()
        assert (shared.rank, shared.device_uuid, shared.shape, shared.dtype) == (1, "", (4, 2, 16, 1, 8), "float32")
        views = import_kv(shared, (4, 2, 16, 1, 8), "float32", 2)
        for i, t in enumerate(views):
            t[3, 1, 5, 0, 7] = 10.0 + i
        parent.send("go")
        assert parent.recv() == [10.0, 11.0]  # the worker sees rank 0's writes
        assert parent.recv() == "written"
        assert bool((views[1][0] == 2.5).all()) and not views[0][0].any()  # and rank 0 sees the worker's
        parent.send("done")
    finally:
        p.join(60)  # (exiting a torch process takes seconds on a loaded machine)
        if p.is_alive():
            p.kill()
            p.join(5)
    assert p.exitcode == 0


def _shared(shape=(4, 2, 16, 1, 8), layers=2, uuid="") -> SharedKV:
    return SharedKV(1, uuid, [(None, ())] * layers, shape, "float32")


@pytest.mark.parametrize("shape, dtype, layers, problem", [
    ((4, 2, 16, 2, 8), "float32", 2, r"rank 1 shared a KV cache of 2 layers of \[4, 2, 16, 1, 8\] float32; "
                                     r"rank 0 expects 2 of \[4, 2, 16, 2, 8\] float32"),
    ((4, 2, 16, 1, 8), "bfloat16", 2, "rank 0 expects 2 of .* bfloat16"),
    ((4, 2, 16, 1, 8), "float32", 3, "rank 0 expects 3 of"),
])
def test_a_cache_that_is_not_the_ranks_is_refused(shape, dtype, layers, problem):
    with pytest.raises(RuntimeError, match=problem):
        import_kv(_shared(), shape, dtype, layers)


def test_a_handle_opens_on_rank_0s_index_of_its_gpu():
    # a Ray rank exports from its cuda:0; rank 0 sees that GPU as its index 1
    shared = _shared(uuid="GPU-b")
    assert local_index(shared, ["GPU-a", "GPU-b"]) == 1
    args = tuple(range(15))  # rebuild_cuda_tensor's 15 arguments; the 7th is the storage's device
    assert on_device(args, 1) == (0, 1, 2, 3, 4, 5, 1, 7, 8, 9, 10, 11, 12, 13, 14)


def test_a_gpu_rank_0_does_not_see_is_refused_naming_it():
    with pytest.raises(RuntimeError, match="rank 1's KV cache is on GPU GPU-c, which rank 0 does not see"):
        import_kv(_shared(uuid="GPU-c"), (4, 2, 16, 1, 8), "float32", 2, uuids=["GPU-a"])


def test_llm_refuses_more_ranks_than_gpus_naming_both(tmp_path):
    from engine.parallel.devices import cuda_device_count
    from engine.parallel.shm import SEGMENT_PREFIX, SHM_DIR

    save_tiny_model(tmp_path, "llama", num_attention_heads=8, num_key_value_heads=8, hidden_size=64)
    mine = lambda: {n for n in os.listdir(SHM_DIR) if n.startswith(f"{SEGMENT_PREFIX}{os.getpid()}-")}  # noqa: E731
    before, seen = mine(), cuda_device_count()
    tp = 2 if seen < 2 else 8 if seen < 8 else pytest.skip("this host has 8 GPUs or more")
    with pytest.raises(ConfigError, match=f"{tp} ranks need {tp} GPUs \\(one each\\) and this host sees {seen}"):
        LLM(str(tmp_path), dtype="float32", device="cuda", tensor_parallel_size=tp, num_kv_blocks=8)
    assert mine() <= before  # the group's segment went with the refusal


def _ray_ranks_views(size: int) -> dict:
    """In a Ray of its own with 4 GPUs (its resource only: this host may have none), under
    CUDA_VISIBLE_DEVICES=4,5,6,7: what each rank actor of a replica's placement group sees once it
    chose its GPUs, and what an actor in the same kind of bundle sees without gpu_rank_options."""
    import ray

    from cluster.tp_ranks import gpu_rank_options, in_bundle, place_replica, see_replica_gpus
    from cluster.types import Stage

    class Rank:
        def view(self, rank: int) -> tuple[list[str], str]:
            before = os.environ.get("CUDA_VISIBLE_DEVICES")
            see_replica_gpus(rank)
            return [before, os.environ["CUDA_VISIBLE_DEVICES"], [str(i) for i in ray.get_gpu_ids()]]

    class Plain:
        def view(self) -> str:
            return os.environ.get("CUDA_VISIBLE_DEVICES")

    ray.init(address="local", num_cpus=2, num_gpus=4, include_dashboard=False, log_to_driver=False)
    try:
        options = {"num_cpus": 0.1, "num_gpus": 1}
        pg = place_replica("gpu-view", Stage.DECODE, size, options, "STRICT_PACK", 60.0)
        actors = [ray.remote(Rank).options(**options, **gpu_rank_options(options),
                                           scheduling_strategy=in_bundle(pg, r)).remote() for r in range(size)]
        views = ray.get([a.view.remote(r) for r, a in enumerate(actors)], timeout=120)
        plain = ray.remote(Plain).options(**options).remote()
        return {"ranks": views, "plain": ray.get(plain.view.remote(), timeout=120)}
    finally:
        ray.shutdown()


def test_ray_rank_actors_of_a_gpu_replica_see_every_gpu_of_it_their_own_first(tmp_path):
    """Over a real Ray (fake GPUs: no CUDA is touched): Ray leaves the ranks' CUDA_VISIBLE_DEVICES to
    them, and each one's list starts with its own GPU and holds every other rank's, so rank 0 can open
    their caches; an actor started without the options sees only its own GPU, as Ray sets it."""
    import json
    import subprocess
    import sys

    out = tmp_path / "views.json"
    code = ("import json; from tests.engine.test_tp_cuda_config import _ray_ranks_views; "
            f"json.dump(_ray_ranks_views(3), open({str(out)!r}, 'w'))")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="4,5,6,7")
    env.pop("RAY_ADDRESS", None)
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=300,
                   cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    views = json.loads(out.read_text())
    ranks = views["ranks"]
    assert [before for before, _, _ in ranks] == ["4,5,6,7"] * 3  # Ray did not narrow it
    owns = [ids for _, _, ids in ranks]
    assert all(len(ids) == 1 for ids in owns) and len({ids[0] for ids in owns}) == 3, owns  # a GPU each
    for (_, visible, ids) in ranks:
        seen = visible.split(",")
        assert seen[0] == ids[0] and sorted(seen) == ["4", "5", "6", "7"], (visible, ids)
    assert views["plain"] in ("4", "5", "6", "7")  # without gpu_rank_options, Ray's own narrowing
