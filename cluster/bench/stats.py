"""The benchmark's statistics, as pure functions over request records.

No I/O and no clock here: every function takes what was measured and returns
numbers, so each can be tested alone. Times in a `RequestRecord` are seconds;
summaries report latencies in milliseconds.

Definitions (per rate):

- TTFT: send → first output token. E2E: send → last message.
- ITL: the gaps between consecutive output tokens. When one message carries
  k > 1 tokens, its gap is split evenly over them (k entries of gap/k); the
  extra tokens of the first message get gaps of 0. So a request has one ITL
  per token after the first, and ``sum(itls) == e2e - ttft`` up to the tail
  after the last token.
- TPOT: ``(e2e - ttft) / (num_output_tokens - 1)``; undefined for a single
  token (such a request meets any TPOT SLO).
- A request meets the SLOs when it succeeded and its TTFT and TPOT are within
  them (an SLO of None is no constraint). Attainment is the fraction of the
  measured requests that were sent (failed ones count as misses); goodput is
  the number meeting both per second of the run.
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

PERCENTILES = (50, 90, 99)
ATTAINMENT_TARGET = 0.9


@dataclass
class RequestRecord:
    """What happened to one request. Times are seconds from the start of its run."""

    index: int
    prompt_len: int  # tokens (for text prompts: the server's count when it reports usage, else words)
    output_len: int  # requested
    scheduled_s: float = 0.0  # when the arrival process released it
    start_s: float | None = None  # when it was sent (later than scheduled under --max-concurrency)
    ttft_s: float | None = None
    itls_s: list[float] = field(default_factory=list)
    end_s: float | None = None
    num_output_tokens: int = 0
    is_ok: bool = False
    error_code: str | None = None
    error_message: str | None = None

    @property
    def e2e_s(self) -> float | None:
        if self.start_s is None or self.end_s is None:
            return None
        return self.end_s - self.start_s

    @property
    def tpot_s(self) -> float | None:
        e2e = self.e2e_s
        if e2e is None or self.ttft_s is None or self.num_output_tokens < 2:
            return None
        return (e2e - self.ttft_s) / (self.num_output_tokens - 1)


@dataclass(frozen=True)
class Slo:
    """Latency objectives in milliseconds; None means unconstrained."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None


def percentile(values: Sequence[float], p: float) -> float | None:
    """The p-th percentile (0..100) with linear interpolation; None for no values."""
    if not 0 <= p <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {p}")
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * p / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def distribution(values_s: Sequence[float]) -> dict[str, float | None]:
    """mean, p50, p90, p99 in milliseconds of values given in seconds (all None when empty)."""
    ms = [v * 1000.0 for v in values_s]
    out: dict[str, float | None] = {"mean": sum(ms) / len(ms) if ms else None}
    for p in PERCENTILES:
        out[f"p{p}"] = percentile(ms, p)
    return out


def meets_slo(rec: RequestRecord, slo: Slo) -> bool:
    if not rec.is_ok:
        return False
    if slo.ttft_ms is not None and (rec.ttft_s is None or rec.ttft_s * 1000.0 > slo.ttft_ms):
        return False
    tpot = rec.tpot_s
    return slo.tpot_ms is None or tpot is None or tpot * 1000.0 <= slo.tpot_ms


def slo_attainment(records: Sequence[RequestRecord], slo: Slo) -> float | None:
    """Fraction of the sent requests that succeeded within the SLOs; None when none was sent."""
    sent = [r for r in records if r.start_s is not None]
    if not sent:
        return None
    return sum(meets_slo(r, slo) for r in sent) / len(sent)


def goodput(records: Sequence[RequestRecord], slo: Slo, duration_s: float) -> float:
    """Requests per second that succeeded within the SLOs."""
    if duration_s <= 0:
        return 0.0
    return sum(meets_slo(r, slo) for r in records) / duration_s


def run_duration(records: Sequence[RequestRecord]) -> float:
    """From the run's start (0) to the last request's end."""
    return max((r.end_s for r in records if r.end_s is not None), default=0.0)


def summarize(records: Sequence[RequestRecord], slo: Slo, duration_s: float | None = None) -> dict:
    """The per-rate summary reported in results.json (latencies in ms, throughputs per second).

    ``records`` holds every measured request, those never sent (start_s None) included.
    """
    duration = run_duration(records) if duration_s is None else duration_s
    ok = [r for r in records if r.is_ok]
    per_s = (lambda n: n / duration) if duration > 0 else (lambda n: 0.0)
    num_in = sum(r.prompt_len for r in ok)
    num_out = sum(r.num_output_tokens for r in ok)
    errors = Counter(r.error_code or "UNKNOWN" for r in records if not r.is_ok and r.start_s is not None)
    return {
        "num_requests": len(records),
        "num_sent": sum(r.start_s is not None for r in records),
        "num_completed": len(ok),
        "num_failed": sum(errors.values()),
        "num_not_sent": sum(r.start_s is None for r in records),
        "duration_s": duration,
        "total_input_tokens": num_in,
        "total_output_tokens": num_out,
        "request_throughput": per_s(len(ok)),
        "output_token_throughput": per_s(num_out),
        "total_token_throughput": per_s(num_in + num_out),
        "ttft_ms": distribution([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_ms": distribution([t for t in (r.tpot_s for r in ok) if t is not None]),
        "itl_ms": distribution([g for r in ok for g in r.itls_s]),
        "e2e_ms": distribution([e for e in (r.e2e_s for r in ok) if e is not None]),
        "slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms},
        "goodput": goodput(records, slo, duration),
        "slo_attainment": slo_attainment(records, slo),
        "errors": dict(sorted(errors.items())),
    }


def max_rate_at_attainment(points: Iterable[tuple[float, float | None]],
                           target: float = ATTAINMENT_TARGET) -> float | None:
    """The highest request rate whose SLO attainment is at least ``target``; None if none is.

    ``points`` are (rate, attainment) pairs; the rate may be ``inf`` (all at once).
    """
    passing = [rate for rate, att in points if att is not None and att >= target]
    return max(passing) if passing else None
