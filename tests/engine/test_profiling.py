"""A profiler window on a stage loop: a Chrome trace with the phase ranges."""
from __future__ import annotations

import json
import time

import pytest

from engine import profiling
from engine.config import EngineConfig
from engine.sampling import SamplingParams
from tests.engine.factories import save_tiny_model


@pytest.fixture
def stage(tmp_path):
    from decode.stage import DecodeStage

    save_tiny_model(tmp_path / "model")
    stage = DecodeStage("colocated-0", str(tmp_path / "model"),
                        EngineConfig(dtype="float32", num_kv_blocks=32, max_num_batched_tokens=64))
    yield stage
    stage.close()


def _run_one(stage, request_id: str, max_tokens: int = 6) -> list:
    from engine.serving.frames import Submit
    from tests.stages.harness import Driver

    driver = Driver(stage)
    driver.send(Submit(request_id, [5, 6, 7, 8, 9], SamplingParams(max_tokens=max_tokens, temperature=0,
                                                                    ignore_eos=True)))
    return driver.stream(request_id, timeout_s=60)


def test_profile_window_writes_a_chrome_trace_with_the_phases(stage, tmp_path):
    stage.start_profile(str(tmp_path / "traces"))
    with pytest.raises(RuntimeError, match="already running"):
        stage.start_profile(str(tmp_path / "traces"))
    deltas = _run_one(stage, "r1")
    (path,) = stage.stop_profile()  # one rank: one trace
    assert deltas[-1].finish_reason == "length"
    assert path.startswith(str(tmp_path / "traces" / "colocated-0-")) and path.endswith(".json")
    trace = json.loads(open(path).read())
    names = {e.get("name") for e in trace["traceEvents"]}
    for phase in (profiling.SCHEDULE, profiling.FORWARD, profiling.SAMPLE, profiling.UPDATE):
        assert phase in names, phase
    assert not profiling._is_on  # ranges are off again once the window is closed (CPU)
    with pytest.raises(RuntimeError, match="no profile"):
        stage.stop_profile()
    assert stage.is_fully_free()


def test_finished_delta_carries_wall_times_in_order(stage):
    t0 = time.time()
    last = _run_one(stage, "r2")[-1]
    t = last.timings
    order = ["queued", "first_scheduled", "first_token", "first_decode", "finished"]
    assert [k for k in order if getattr(t, k) is not None] == order
    assert t0 <= t.queued and all(getattr(t, a) <= getattr(t, b) for a, b in zip(order, order[1:]))
    assert t.finished <= time.time()


def test_phase_is_a_shared_no_op_when_nobody_profiles():
    assert not profiling._is_on
    # one shared context object, nothing allocated or recorded per phase (its cost
    # is measured in BENCHMARKS-style microbenchmarks, not asserted in a timed test)
    assert profiling.phase(profiling.FORWARD) is profiling.phase(profiling.SAMPLE)
    with profiling.phase(profiling.FORWARD):
        assert not profiling._is_on
