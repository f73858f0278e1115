"""The plain-Python core imports no torch, Ray or gRPC: the block pool, the
scheduler (with the `Sequence` and `SamplingParams` it moves), the router,
the transfer planner and the serving vocabulary can be used and tested
alone. Each import runs in a fresh interpreter in which those packages
cannot be imported at all."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

BLOCKED = ("torch", "ray", "grpc", "numpy")

CORE = [
    "engine.block_pool",
    "engine.kv_manager",
    "engine.sequence",
    "engine.sampling",
    "engine.scheduler",
    "engine.serving.types",
    "engine.serving.frames",
    "cluster.router",
    "kvtransfer.planner",
    "kvtransfer.reshard",
]


def _run(code: str) -> subprocess.CompletedProcess:
    blocker = textwrap.dedent(f"""
        import importlib.abc, sys
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in {BLOCKED!r}:
                    raise ImportError(f"{{name}} is blocked: the core must not import it")
        sys.meta_path.insert(0, Block())
    """)
    return subprocess.run([sys.executable, "-c", blocker + code], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("module", CORE)
def test_imports_without_torch_ray_or_grpc(module):
    r = _run(f"import {module}")
    assert r.returncode == 0, r.stderr


def test_the_blocker_blocks():
    r = _run("import torch")
    assert r.returncode != 0 and "blocked" in r.stderr


def test_the_scheduler_runs_a_batch_without_torch():
    """Not only imports: schedule a prompt, chunk it, decode, preempt, with torch unavailable."""
    r = _run(textwrap.dedent("""
        from engine.block_pool import BlockPool
        from engine.kv_manager import KVCacheManager
        from engine.sampling import SamplingParams
        from engine.scheduler import Scheduler, SchedulerConfig
        from engine.sequence import Sequence
        sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8, max_model_len=64),
                          KVCacheManager(BlockPool(8), 4))
        seq = Sequence("a", list(range(10)), SamplingParams(max_tokens=3, seed=1, temperature=1.0))
        sched.add(seq)
        out = sched.schedule()
        assert [s.num_new_tokens for s in out.scheduled] == [8]
        sched.update(out, {})
        out = sched.schedule()
        assert [s.num_new_tokens for s in out.scheduled] == [2] and out.scheduled[0].samples
        sched.update(out, {"a": (5, None)})
        assert seq.output_token_ids == [5]
        print("ok")
    """))
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
