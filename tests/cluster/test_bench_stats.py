"""The benchmark's pure parts: statistics and workload generation."""
import math
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.bench.clients import add_tokens
from cluster.bench.stats import (RequestRecord, Slo, distribution, goodput, max_rate_at_attainment, meets_slo,
                                 percentile, slo_attainment, summarize)
from cluster.bench.workload import (WorkloadError, arrival_offsets, dataset_requests, random_requests,
                                    sample_lengths)


def make_record(ttft=0.1, tpot=0.01, n=10, is_ok=True, start=0.0, index=0, prompt_len=8):
    rec = RequestRecord(index, prompt_len, n, start_s=start, ttft_s=ttft, num_output_tokens=n, is_ok=is_ok)
    rec.itls_s = [tpot] * (n - 1)
    rec.end_s = start + ttft + tpot * (n - 1)
    if not is_ok:
        rec.error_code = "UNAVAILABLE"
    return rec


records_st = st.lists(st.builds(make_record, ttft=st.floats(0, 5), tpot=st.floats(0, 0.5),
                                n=st.integers(1, 40), is_ok=st.booleans(), start=st.floats(0, 10)), max_size=25)
slo_ms = st.one_of(st.none(), st.floats(0, 6000))


# ---- percentiles and distributions ------------------------------------------------------------------------
@settings(deadline=None)
@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=50), st.floats(0, 100))
def test_percentile_matches_numpy_linear(values, p):
    assert percentile(values, p) == pytest.approx(float(np.percentile(values, p)), rel=1e-9, abs=1e-6)


@settings(deadline=None)
@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=50), st.floats(0, 100), st.floats(0, 100))
def test_percentile_is_monotone_and_bounded(values, p, q):
    lo, hi = sorted((p, q))
    assert min(values) <= percentile(values, lo) <= percentile(values, hi) <= max(values)


def test_percentile_edges():
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1, 2, 3, 4], 50) == 2.5
    with pytest.raises(ValueError, match="percentile must be in"):
        percentile([1], 101)
    assert distribution([]) == {"mean": None, "p50": None, "p90": None, "p99": None}
    assert distribution([0.001, 0.003]) == pytest.approx({"mean": 2.0, "p50": 2.0, "p90": 2.8, "p99": 2.98})


# ---- per-request metrics ----------------------------------------------------------------------------------
def test_tpot_and_e2e():
    rec = make_record(ttft=0.2, tpot=0.05, n=5, start=1.0)
    assert rec.e2e_s == pytest.approx(0.4) and rec.tpot_s == pytest.approx(0.05)
    assert make_record(n=1).tpot_s is None  # no gap to average
    assert RequestRecord(0, 1, 1).e2e_s is None


def test_add_tokens_spreads_a_multi_token_message():
    rec = RequestRecord(0, 4, 5, start_s=1.0)
    last = add_tokens(rec, 1.5, 2, None)  # first message: two tokens
    last = add_tokens(rec, 1.5, 0, last)  # an empty message changes nothing
    last = add_tokens(rec, 1.8, 3, last)
    assert rec.ttft_s == pytest.approx(0.5) and rec.num_output_tokens == 5
    assert rec.itls_s == pytest.approx([0.0, 0.1, 0.1, 0.1])  # one per token after the first
    assert last == 1.8


def test_meets_slo():
    fast = make_record(ttft=0.1, tpot=0.01)
    assert meets_slo(fast, Slo(100, 10)) and meets_slo(fast, Slo())
    assert not meets_slo(fast, Slo(ttft_ms=99)) and not meets_slo(fast, Slo(tpot_ms=9))
    assert not meets_slo(make_record(is_ok=False), Slo())  # a failure never meets an SLO
    assert meets_slo(make_record(n=1), Slo(tpot_ms=0.001))  # one token: TPOT undefined, not a miss


# ---- attainment, goodput, max rate ------------------------------------------------------------------------
@settings(deadline=None)
@given(records_st, slo_ms, slo_ms, st.floats(0, 6000), st.floats(0, 6000))
def test_attainment_is_monotone_in_the_slo(records, ttft, tpot, more_ttft, more_tpot):
    tight = Slo(ttft, tpot)
    loose = Slo(None if ttft is None else ttft + more_ttft, None if tpot is None else tpot + more_tpot)
    a, b = slo_attainment(records, tight), slo_attainment(records, loose)
    if not records:
        assert a is None and b is None
    else:
        assert 0 <= a <= b <= 1


@settings(deadline=None)
@given(records_st, slo_ms, slo_ms)
def test_goodput_never_exceeds_throughput(records, ttft, tpot):
    s = summarize(records, Slo(ttft, tpot))
    assert s["goodput"] <= s["request_throughput"] + 1e-12
    assert s["num_completed"] + s["num_failed"] == s["num_sent"] == len(records)
    if records and s["duration_s"] > 0:
        assert s["goodput"] == pytest.approx(s["slo_attainment"] * len(records) / s["duration_s"])


def test_summarize_counts_errors_and_unsent():
    recs = [make_record(index=i) for i in range(3)] + [make_record(is_ok=False), RequestRecord(9, 8, 10)]
    s = summarize(recs, Slo(ttft_ms=150))
    assert (s["num_requests"], s["num_sent"], s["num_completed"], s["num_failed"], s["num_not_sent"]) == (5, 4, 3, 1, 1)
    assert s["errors"] == {"UNAVAILABLE": 1}
    assert s["slo_attainment"] == 0.75  # the failure counts as a miss; the unsent one not at all
    assert s["total_output_tokens"] == 30 and s["total_input_tokens"] == 24
    assert s["ttft_ms"]["p50"] == pytest.approx(100) and s["tpot_ms"]["mean"] == pytest.approx(10)
    assert s["duration_s"] == pytest.approx(0.19) and s["request_throughput"] == pytest.approx(3 / 0.19)
    assert goodput(recs, Slo(ttft_ms=50), 1.0) == 0.0


def test_max_rate_at_attainment():
    assert max_rate_at_attainment([]) is None
    assert max_rate_at_attainment([(1, 0.5), (2, None)]) is None
    assert max_rate_at_attainment([(1, 1.0), (2, 0.95), (4, 0.89), (8, 0.2)]) == 2
    assert max_rate_at_attainment([(1, 0.9), (math.inf, 0.9)]) == math.inf
    assert max_rate_at_attainment([(1, 0.8), (2, 0.85)], target=0.8) == 2


@settings(deadline=None)
@given(st.lists(st.tuples(st.floats(0.01, 1e3), st.one_of(st.none(), st.floats(0, 1))), max_size=10))
def test_max_rate_is_the_highest_passing_rate(points):
    best = max_rate_at_attainment(points)
    passing = [r for r, a in points if a is not None and a >= 0.9]
    assert best == (max(passing) if passing else None)


# ---- workload ---------------------------------------------------------------------------------------------
@settings(deadline=None)
@given(st.integers(1, 2000), st.floats(0, 0.99), st.integers(0, 2**32))
def test_lengths_stay_in_their_range(mean, ratio, seed):
    lens = sample_lengths(random.Random(seed), mean, ratio, 20)
    assert all(max(1, math.floor(mean * (1 - ratio))) <= n <= math.ceil(mean * (1 + ratio)) for n in lens)


def test_random_requests():
    a = random_requests(20, 16, 8, 0.5, seed=1, vocab_size=100)
    assert a == random_requests(20, 16, 8, 0.5, seed=1, vocab_size=100)  # seeded
    assert all(len(s.prompt) == s.prompt_len and all(0 <= t < 100 for t in s.prompt) for s in a)
    assert len({s.prompt_len for s in a}) > 1
    b = random_requests(20, 16, 8, 0.5, seed=1, vocab_size=100, variant=1)
    assert [(s.prompt_len, s.output_len) for s in a] == [(s.prompt_len, s.output_len) for s in b]
    assert [s.prompt for s in a] != [s.prompt for s in b]  # fresh content: no prefix-cache carry-over
    text = random_requests(3, 5, 4, 0.0, seed=1)
    assert all(isinstance(s.prompt, str) and len(s.prompt.split()) == 5 for s in text)
    with pytest.raises(WorkloadError, match="range-ratio"):
        random_requests(1, 4, 4, 1.0, seed=0)


def test_arrivals():
    assert arrival_offsets(3, math.inf, 1.0, 0) == [0, 0, 0]
    for shape in (0.25, 1.0, 4.0):
        t = arrival_offsets(4001, 10.0, shape, seed=3)
        gaps = np.diff(t)
        assert t[0] == 0 and (gaps >= 0).all()
        assert gaps.mean() == pytest.approx(0.1, rel=0.1)
        assert gaps.var() / gaps.mean() ** 2 == pytest.approx(1 / shape, rel=0.25)  # CV^2 of a gamma
    with pytest.raises(WorkloadError, match="burstiness"):
        arrival_offsets(2, 1.0, 0.0, 0)


def test_dataset(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a b c", "output_len": 3}\n\n{"prompt": "d e"}\n')
    specs = dataset_requests(path, 5, default_output_len=7, seed=0)
    assert len(specs) == 5 and {(s.prompt, s.output_len) for s in specs} == {("a b c", 3), ("d e", 7)}
    path.write_text('{"prompt": "ok"}\n{"text": "no prompt"}\n')
    with pytest.raises(WorkloadError, match=r"d.jsonl:2: needs a non-empty string field 'prompt'"):
        dataset_requests(path, 1, 7, 0)
    path.write_text('{"prompt": "x", "output_len": 0}\n')
    with pytest.raises(WorkloadError, match="output_len must be an integer >= 1"):
        dataset_requests(path, 1, 7, 0)
