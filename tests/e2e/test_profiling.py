"""Profiling a running cluster: a window at startup from the spec, a trace
per replica from the Profile RPC, and per-request timelines. One small
disaggregated cluster (1 prefill + 1 decode)."""
from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from engine import profiling
from tests.e2e.conftest import disagg_spec, running_cluster


@pytest.fixture(scope="module")
def startup_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("startup-traces")


@pytest.fixture(scope="module")
def cluster(ray_instance, startup_dir):
    with running_cluster(disagg_spec(1, 1, profile={"dir": str(startup_dir), "seconds": 0.5})) as rc:
        rc.run(_finished(rc.cluster._startup_profile))  # closed before the tests open their windows
        yield rc


def test_spec_profile_window_at_startup(cluster, startup_dir):
    files = sorted(p.name for p in startup_dir.glob("*.json"))
    assert [f.split("-2")[0] for f in files] == ["decode-0", "prefill-0"], files
    for f in startup_dir.glob("*.json"):
        assert json.loads(f.read_text())["traceEvents"] is not None


async def _finished(task) -> None:
    await task


def _names(path: str) -> set[str]:
    return {e.get("name") for e in json.loads(Path(path).read_text())["traceEvents"]}


def test_profile_rpc_writes_one_trace_per_replica(cluster, tmp_path):
    long = cluster.client.stream("Tell me a long story about a dragon.", max_tokens=400, temperature=0,
                                 ignore_eos=True)
    next(long)  # decoding while the window is open
    with ThreadPoolExecutor(1) as pool:
        profile = pool.submit(cluster.client.profile, 1.5, str(tmp_path))
        time.sleep(0.3)
        for i in range(3):  # prefills (and their KV transfers) inside the window
            cluster.client.generate(f"Count to {i + 3}.", max_tokens=2, temperature=0)
        traces = profile.result(timeout=120)
    long.close()
    assert sorted(t.replica_id for t in traces) == ["decode-0", "prefill-0"]
    by_replica = {t.replica_id: t for t in traces}
    for rid, t in by_replica.items():
        assert t.host and Path(t.path).parent == tmp_path and Path(t.path).name.startswith(f"{rid}-")
    prefill = _names(by_replica["prefill-0"].path)
    want = {profiling.SCHEDULE, profiling.FORWARD, profiling.SAMPLE, profiling.UPDATE,
            profiling.KV_TRANSFER_START, profiling.KV_COMMIT}
    assert want <= prefill, want - prefill
    decode = _names(by_replica["decode-0"].path)
    assert {profiling.SCHEDULE, profiling.FORWARD, profiling.SAMPLE, profiling.RECEIVER_POLL} <= decode
    assert cluster.wait_pools_free() == {"prefill-0": True, "decode-0": True}


def test_timeline_is_monotone_with_every_phase(cluster):
    result = cluster.client.generate("What is the capital of France?", max_tokens=8, temperature=0,
                                     ignore_eos=True, timeline=True)
    phases = result.timeline.phases()
    assert list(phases) == ["routed_s", "prefill_queued_s", "prefill_start_s", "prefill_end_s",
                            "kv_transfer_done_s", "first_decode_step_s", "finish_s"], phases
    times = list(phases.values())
    assert 0 <= times[0] and times == sorted(times), phases
    assert times[-1] < 120
    assert cluster.client.generate("Hi", max_tokens=2).timeline is None
    assert cluster.wait_pools_free() == {"prefill-0": True, "decode-0": True}
