"""Prometheus metrics of a kvrelay frontend process.

One `ServingMetrics` per server, with its own `CollectorRegistry` (never the
global one, so two servers in a process, or in a test, do not mix). Three
sources feed it:

1. The frontends (gRPC and HTTP), through `cluster.serving.run_request`, the
   one place that watches a request's deltas: time to first token,
   inter-token latency, end-to-end latency, token counts and the outcome.
   Requests refused before they reach the backend (bad input, bad key) are
   counted with `count_rejected`.
2. The backend's stage-side timings, the `StageMetrics` on a request's last
   delta (`observe_stage_metrics`): queue, prefill and KV transfer time,
   transfer bytes and failures.
3. `backend.status()`, read at scrape time (`refresh`): per-replica gauges
   labelled by ``stage`` and ``replica``, and the router's queue depth.

Names (all prefixed ``kvrelay_``; times in seconds):

    time_to_first_token_seconds, inter_token_latency_seconds,
    e2e_request_latency_seconds, queue_time_seconds, prefill_time_seconds,
    kv_transfer_time_seconds                                    histograms
    requests_total{frontend, outcome}, prompt_tokens_total,
    generation_tokens_total, kv_transfer_bytes_total,
    kv_transfer_failures_total, request_migrations_total{cause},
    requests_lost_total{cause}                                  counters
    requests_in_flight{frontend}, router_waiting_requests,
    replica_up / replica_running_seqs / replica_queued_prefill_tokens /
    replica_in_flight_requests / replica_kv_usage_ratio /
    replica_kv_blocks_total / replica_restarts {stage, replica} gauges

``outcome`` is a finish reason (stop, length, abort, error) or why the
request was refused (invalid_request, unauthenticated, overloaded,
no_replica).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric

from cluster.types import ClusterStatus, GenerateDelta, GenerateRequest, StageMetrics

log = logging.getLogger(__name__)

CONTENT_TYPE = CONTENT_TYPE_LATEST

# Buckets sized for LLM serving: TTFT and prefill from milliseconds to a long
# prompt under load; ITL around a decode step; e2e and queue up to minutes.
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0,
                20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
               0.2, 0.3, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 120.0, 300.0, 600.0)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

_REPLICA_GAUGES = (  # (name, help, value of a ReplicaStatus)
    ("replica_up", "1 if the replica is alive", lambda r: float(r.is_alive)),
    ("replica_running_seqs", "Sequences in the replica's running batch", lambda r: r.num_running_seqs),
    ("replica_queued_prefill_tokens", "Prompt tokens waiting for prefill (the replica's queue depth)",
     lambda r: r.num_queued_prefill_tokens),
    ("replica_in_flight_requests", "Requests the router placed on the replica and not yet released",
     lambda r: r.num_in_flight),
    ("replica_kv_usage_ratio", "Fraction of the replica's KV cache blocks in use (0..1)", lambda r: r.kv_usage),
    ("replica_kv_blocks_total", "KV cache blocks of the replica", lambda r: r.num_total_blocks),
    ("replica_restarts", "Times the replica was replaced after it died, stalled or its loop failed",
     lambda r: r.num_restarts),
    ("replica_tensor_parallel_size", "Ranks of the replica (one process each)", lambda r: r.tensor_parallel_size),
)


class _StatusCollector:
    """Replica and router gauges from the last `ClusterStatus` (`ServingMetrics.refresh`).

    A dead replica has only ``kvrelay_replica_up`` 0: its load series are left out.
    """

    def __init__(self):
        self.status: ClusterStatus | None = None

    def collect(self) -> Iterator[Metric]:
        status = self.status
        if status is None:
            return
        for name, doc, value in _REPLICA_GAUGES:
            family = GaugeMetricFamily(f"kvrelay_{name}", doc, labels=["stage", "replica"])
            for r in status.replicas:
                if r.is_alive or name == "replica_up":  # a dead replica's last load is not its load now
                    family.add_metric([r.stage.value, r.replica_id], float(value(r)))
            yield family
        ranks = GaugeMetricFamily("kvrelay_replica_rank_pid", "Process id of each rank of a live replica",
                                  labels=["stage", "replica", "rank"])
        for r in status.replicas:
            if r.is_alive:
                for rank, pid in enumerate(r.rank_pids):
                    ranks.add_metric([r.stage.value, r.replica_id, str(rank)], float(pid))
        yield ranks
        yield GaugeMetricFamily("kvrelay_router_waiting_requests", "Requests in the router's admission queue",
                                value=status.num_waiting)


class ServingMetrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        p = "kvrelay_"
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Arrival at the frontend to the first token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(p + "inter_token_latency_seconds", "Time between consecutive generated tokens",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "Arrival at the frontend to the request's end",
                             buckets=E2E_BUCKETS, registry=r)
        self.queue_time = Histogram(p + "queue_time_seconds", "Arrival at the router to the start of prefill",
                                    buckets=QUEUE_BUCKETS, registry=r)
        self.prefill_time = Histogram(p + "prefill_time_seconds", "Start of prefill to the first token",
                                      buckets=TTFT_BUCKETS, registry=r)
        self.transfer_time = Histogram(p + "kv_transfer_time_seconds", "KV cache transfer of one request",
                                       buckets=TRANSFER_BUCKETS, registry=r)
        self.requests = Counter(p + "requests", "Requests by frontend and outcome (finish reason or refusal)",
                                ["frontend", "outcome"], registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of requests that got a first token",
                                     registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Generated tokens sent to clients", registry=r)
        self.transfer_bytes = Counter(p + "kv_transfer_bytes", "KV cache bytes moved between stages", registry=r)
        self.transfer_failures = Counter(p + "kv_transfer_failures", "KV cache transfers that failed", registry=r)
        self.migrations = Counter(p + "request_migrations", "Requests placed again after a replica failure, by cause",
                                  ["cause"], registry=r)
        self.lost = Counter(p + "requests_lost", "Requests a replica failure ended (migrations exhausted or off), "
                            "by the failure's cause", ["cause"], registry=r)
        self.in_flight = Gauge(p + "requests_in_flight", "Requests a frontend is running in the backend",
                               ["frontend"], registry=r)
        self._status = _StatusCollector()
        r.register(self._status)

    # ---- observations ----------------------------------------------------------
    def start_request(self, frontend: str, request: GenerateRequest) -> RequestMetrics:
        return RequestMetrics(self, frontend, request)

    def count_rejected(self, frontend: str, outcome: str) -> None:
        """A request refused before it reached the backend (``invalid_request``, ``unauthenticated``)."""
        self.requests.labels(frontend, outcome).inc()

    def observe_stage_metrics(self, m: StageMetrics) -> None:
        if m.queue_time_s is not None:
            self.queue_time.observe(m.queue_time_s)
        if m.prefill_time_s is not None:
            self.prefill_time.observe(m.prefill_time_s)
        if m.kv_transfer_time_s is not None:
            self.transfer_time.observe(m.kv_transfer_time_s)
        if m.kv_transfer_bytes:
            self.transfer_bytes.inc(m.kv_transfer_bytes)
        if m.num_kv_transfer_failures:
            self.transfer_failures.inc(m.num_kv_transfer_failures)

    # ---- scraping --------------------------------------------------------------
    async def refresh(self, backend, timeout_s: float = 5.0) -> None:
        """Read ``backend.status()`` for the replica gauges; on failure they are left out of this scrape."""
        try:
            self._status.status = await asyncio.wait_for(backend.status(), timeout_s)
        except Exception:
            log.exception("backend status failed; replica gauges left out")
            self._status.status = None

    def render(self) -> bytes:
        """The Prometheus text exposition of everything in this registry."""
        return generate_latest(self.registry)


class RequestMetrics:
    """The frontend-side observations of one request (`cluster.serving.run_request` drives it)."""

    def __init__(self, metrics: ServingMetrics, frontend: str, request: GenerateRequest):
        self._m = metrics
        self._frontend = frontend
        self._arrival = request.arrival_time  # time.monotonic()
        self._num_prompt_tokens = request.num_prompt_tokens
        self._last_token_time: float | None = None
        metrics.in_flight.labels(frontend).inc()

    def on_delta(self, delta: GenerateDelta) -> None:
        now = time.monotonic()
        n = len(delta.token_ids)
        if n:
            m = self._m
            if self._last_token_time is None:
                m.ttft.observe(now - self._arrival)
                m.prompt_tokens.inc(self._num_prompt_tokens)
            else:  # a delta may carry several tokens (held back for a stop string): spread the gap
                gap = (now - self._last_token_time) / n
                for _ in range(n):
                    m.itl.observe(gap)
            self._last_token_time = now
            m.generation_tokens.inc(n)
        if delta.stage_metrics is not None:
            self._m.observe_stage_metrics(delta.stage_metrics)
        for cause in delta.migrations:
            self._m.migrations.labels(cause).inc()
        if delta.lost_cause:
            self._m.lost.labels(delta.lost_cause).inc()

    def finish(self, outcome: str) -> None:
        m = self._m
        m.in_flight.labels(self._frontend).dec()
        m.requests.labels(self._frontend, outcome).inc()
        if outcome not in ("overloaded", "no_replica", "invalid_request"):  # those never ran
            m.e2e.observe(time.monotonic() - self._arrival)
