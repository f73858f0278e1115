"""The request timeline the Ray backend builds from the stages' `StageTimings`."""
import pytest

from cluster.ray_backend import _timeline
from cluster.types import GenerateRequest, StageTimings


def _request(t0: float) -> GenerateRequest:
    return GenerateRequest("r", [1, 2, 3], timeline=True, arrival_wall_time=t0)


def test_disaggregated_timeline_takes_prefill_and_decode_stamps():
    t0 = 1000.0
    prefill = StageTimings(queued=t0 + 0.02, first_scheduled=t0 + 0.03, first_token=t0 + 0.1)
    decode = StageTimings(queued=t0 + 0.015, first_token=t0 + 0.12, kv_ready=t0 + 0.12, first_decode=t0 + 0.15,
                          finished=t0 + 0.3)
    t = _timeline(_request(t0), t0 + 0.01, decode, prefill, colocated=False)
    phases = t.phases()
    assert list(phases) == ["routed_s", "prefill_queued_s", "prefill_start_s", "prefill_end_s",
                            "kv_transfer_done_s", "first_decode_step_s", "finish_s"]
    assert phases["routed_s"] == pytest.approx(0.01) and phases["prefill_end_s"] == pytest.approx(0.1)
    assert phases["kv_transfer_done_s"] == pytest.approx(0.12) and phases["first_decode_step_s"] == pytest.approx(0.15)
    assert phases["finish_s"] > 0.15  # stamped when the last delta arrives (now)


def test_colocated_timeline_has_no_transfer_and_a_failed_prefill_leaves_gaps():
    t0 = 1000.0
    decode = StageTimings(queued=t0 + 0.02, first_scheduled=t0 + 0.03, first_token=t0 + 0.08)
    t = _timeline(_request(t0), t0 + 0.01, decode, None, colocated=True)
    assert t.kv_transfer_done_s is None and t.first_decode_step_s is None  # max_tokens 1: no decode step
    assert t.prefill_queued_s == pytest.approx(0.02) and t.prefill_end_s == pytest.approx(0.08)
    t = _timeline(_request(t0), t0 + 0.01, StageTimings(), None, colocated=False)
    assert list(t.phases()) == ["routed_s", "finish_s"]
