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

Every series has a ``model_name`` label (the served model's name), as
vLLM's do, so dashboards built for it filter the same way. Names (all
prefixed ``kvrelay_``; times in seconds):

    time_to_first_token_seconds, inter_token_latency_seconds,
    e2e_request_latency_seconds, queue_time_seconds, prefill_time_seconds,
    kv_transfer_time_seconds, request_decode_time_seconds (first token to
    last), request_time_per_output_token_seconds (the same over the tokens
    after the first), request_prompt_tokens,
    request_generation_tokens (per request)                     histograms
    requests_total{frontend, outcome}, prompt_tokens_total,
    generation_tokens_total, kv_transfer_bytes_total,
    kv_transfer_failures_total, request_migrations_total{cause},
    requests_lost_total{cause}                                  counters
    requests_in_flight{frontend}, router_waiting_requests,
    replica_up / replica_running_seqs / replica_queued_prefill_tokens /
    replica_in_flight_requests / replica_kv_usage_ratio /
    replica_kv_blocks / replica_restarts {stage, replica}       gauges
    replica_prompt_tokens_computed_total,
    replica_kv_sent_bytes_total {stage, replica}                counters

Compatibility: the gauge ``replica_kv_blocks`` was ``replica_kv_blocks_total``
before 0.2 (a gauge must not end in ``_total``, which Prometheus reserves for
counters: ``promtool check metrics`` refused it); queries on the old name
need the new one.

``outcome`` is a finish reason (stop, length, abort, error) or why the
request was refused (invalid_request, unauthenticated, overloaded,
no_replica).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from cluster.types import ClusterStatus, GenerateDelta, GenerateRequest, StageMetrics
from engine.serving.timeouts import within

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
DECODE_BUCKETS = E2E_BUCKETS
TPOT_BUCKETS = ITL_BUCKETS
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)

_REPLICA_GAUGES = (  # (name, help, value of a ReplicaStatus)
    ("replica_up", "1 if the replica is alive", lambda r: float(r.is_alive)),
    ("replica_running_seqs", "Sequences in the replica's running batch", lambda r: r.num_running_seqs),
    ("replica_queued_prefill_tokens", "Prompt tokens waiting for prefill (the replica's queue depth)",
     lambda r: r.num_queued_prefill_tokens),
    ("replica_in_flight_requests", "Requests the router placed on the replica and not yet released",
     lambda r: r.num_in_flight),
    ("replica_kv_usage_ratio", "Fraction of the replica's KV cache blocks in use (0..1)", lambda r: r.kv_usage),
    ("replica_kv_blocks", "KV cache blocks of the replica", lambda r: r.num_total_blocks),
    ("replica_restarts", "Times the replica was replaced after it died, stalled or its loop failed",
     lambda r: r.num_restarts),
    ("replica_tensor_parallel_size", "Tensor-parallel ranks of each pipeline stage of the replica",
     lambda r: r.tensor_parallel_size),
    ("replica_pipeline_parallel_size", "Pipeline stages of the replica (its ranks: this x tensor_parallel_size)",
     lambda r: r.pipeline_parallel_size),
)

_REPLICA_COUNTERS = (  # (name, help, value of a ReplicaStatus), since the replica (this incarnation) started
    ("replica_prompt_tokens_computed", "Prompt tokens the replica ran through the model (prefix-cache hits, "
     "forked blocks and KV that came by transfer are not computed; a recompute counts again)",
     lambda r: r.num_prompt_tokens_computed),
    ("replica_kv_sent_bytes", "KV cache bytes of the prefill replica's transfers that ended DONE",
     lambda r: r.num_kv_bytes_sent),
)


class _StatusCollector:
    """Replica and router gauges from the last `ClusterStatus` (`ServingMetrics.refresh`).

    A dead replica has only ``kvrelay_replica_up`` 0: its load series are left out.
    """

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.status: ClusterStatus | None = None

    def collect(self) -> Iterator[Metric]:
        status = self.status
        if status is None:
            return
        for name, doc, value in _REPLICA_GAUGES:
            family = GaugeMetricFamily(f"kvrelay_{name}", doc, labels=["model_name", "stage", "replica"])
            for r in status.replicas:
                if r.is_alive or name == "replica_up":  # a dead replica's last load is not its load now
                    family.add_metric([self.model_name, r.stage.value, r.replica_id], float(value(r)))
            yield family
        yield self._per_index(GaugeMetricFamily, "kvrelay_replica_rank_pid",
                              "Process id of each rank of a live replica", "rank", status, lambda r: r.rank_pids)
        yield self._per_index(CounterMetricFamily, "kvrelay_replica_expert_tokens",
                              "Tokens routed to each expert of a mixture of experts since the replica started, "
                              "summed over its sparse layers (a hot expert shows here)", "expert", status,
                              lambda r: r.expert_load)
        for name, doc, value in _REPLICA_COUNTERS:
            family = CounterMetricFamily(f"kvrelay_{name}", doc, labels=["model_name", "stage", "replica"])
            for r in status.replicas:
                if r.is_alive:
                    family.add_metric([self.model_name, r.stage.value, r.replica_id], float(value(r)))
            yield family
        waiting = GaugeMetricFamily("kvrelay_router_waiting_requests", "Requests in the router's admission queue",
                                    labels=["model_name"])
        waiting.add_metric([self.model_name], status.num_waiting)
        yield waiting


    def _per_index(self, kind, name: str, doc: str, label: str, status, values) -> Metric:
        """A series per (live replica, index) of ``values(replica)``, labelled ``label``."""
        family = kind(name, doc, labels=["model_name", "stage", "replica", label])
        for r in status.replicas:
            if r.is_alive:
                for i, v in enumerate(values(r)):
                    family.add_metric([self.model_name, r.stage.value, r.replica_id, str(i)], float(v))
        return family


class ServingMetrics:
    def __init__(self, model_name: str = ""):
        """``model_name``: the served model's, the ``model_name`` label of every series."""
        self.model_name = model_name
        self.registry = r = CollectorRegistry()
        p = "kvrelay_"
        m = ["model_name"]

        def histogram(name: str, doc: str, buckets):
            return Histogram(p + name, doc, m, buckets=buckets, registry=r).labels(model_name)

        def counter(name: str, doc: str):
            return Counter(p + name, doc, m, registry=r).labels(model_name)

        self.ttft = histogram("time_to_first_token_seconds", "Arrival at the frontend to the first token",
                              TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive generated tokens", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival at the frontend to the request's end",
                             E2E_BUCKETS)
        self.queue_time = histogram("queue_time_seconds", "Arrival at the router to the start of prefill",
                                    QUEUE_BUCKETS)
        self.prefill_time = histogram("prefill_time_seconds", "Start of prefill to the first token", TTFT_BUCKETS)
        self.transfer_time = histogram("kv_transfer_time_seconds", "KV cache transfer of one request",
                                       TRANSFER_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds",
                                     "First token to the last of a request that finished", DECODE_BUCKETS)
        self.tpot = histogram("request_time_per_output_token_seconds",
                              "A finished request's decode time over its tokens after the first", TPOT_BUCKETS)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens of a finished request",
                                               TOKEN_BUCKETS)
        self.request_generation_tokens = histogram("request_generation_tokens",
                                                   "Tokens generated for a finished request", TOKEN_BUCKETS)
        self._requests = Counter(p + "requests", "Requests by frontend and outcome (finish reason or refusal)",
                                 m + ["frontend", "outcome"], registry=r)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that got a first token")
        self.generation_tokens = counter("generation_tokens", "Generated tokens sent to clients")
        self.transfer_bytes = counter("kv_transfer_bytes", "KV cache bytes moved between stages")
        self.transfer_failures = counter("kv_transfer_failures", "KV cache transfers that failed")
        self._migrations = Counter(p + "request_migrations", "Requests placed again after a replica failure, by "
                                   "cause", m + ["cause"], registry=r)
        self._lost = Counter(p + "requests_lost", "Requests a replica failure ended (migrations exhausted or off), "
                             "by the failure's cause", m + ["cause"], registry=r)
        self._in_flight = Gauge(p + "requests_in_flight", "Requests a frontend is running in the backend",
                                m + ["frontend"], registry=r)
        self._status = _StatusCollector(model_name)
        r.register(self._status)

    def requests(self, frontend: str, outcome: str):
        return self._requests.labels(self.model_name, frontend, outcome)

    def migrations(self, cause: str):
        return self._migrations.labels(self.model_name, cause)

    def lost(self, cause: str):
        return self._lost.labels(self.model_name, cause)

    def in_flight(self, frontend: str):
        return self._in_flight.labels(self.model_name, frontend)

    # ---- observations ----------------------------------------------------------
    def start_request(self, frontend: str, request: GenerateRequest) -> RequestMetrics:
        return RequestMetrics(self, frontend, request)

    def count_rejected(self, frontend: str, outcome: str) -> None:
        """A request refused before it reached the backend (``invalid_request``, ``unauthenticated``)."""
        self.requests(frontend, outcome).inc()

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
            self._status.status = await within(backend.status(), timeout_s)
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
        self._first_token_time: float | None = None
        self._last_token_time: float | None = None
        self._num_tokens = 0
        metrics.in_flight(frontend).inc()

    def on_delta(self, delta: GenerateDelta) -> None:
        now = time.monotonic()
        n = len(delta.token_ids)
        if n:
            m = self._m
            if self._last_token_time is None:
                self._first_token_time = now
                m.ttft.observe(now - self._arrival)
                m.prompt_tokens.inc(self._num_prompt_tokens)
            else:  # a delta may carry several tokens (held back for a stop string): spread the gap
                gap = (now - self._last_token_time) / n
                for _ in range(n):
                    m.itl.observe(gap)
            self._last_token_time = now
            self._num_tokens += n
            m.generation_tokens.inc(n)
        if delta.stage_metrics is not None:
            self._m.observe_stage_metrics(delta.stage_metrics)
        for cause in delta.migrations:
            self._m.migrations(cause).inc()
        if delta.lost_cause:
            self._m.lost(delta.lost_cause).inc()

    def finish(self, outcome: str) -> None:
        m = self._m
        m.in_flight(self._frontend).dec()
        m.requests(self._frontend, outcome).inc()
        if outcome not in ("overloaded", "no_replica", "invalid_request"):  # those never ran
            m.e2e.observe(time.monotonic() - self._arrival)
        if outcome in ("stop", "length") and self._first_token_time is not None:  # it finished, with its tokens
            decode_time = self._last_token_time - self._first_token_time
            m.decode_time.observe(decode_time)
            if self._num_tokens > 1:
                m.tpot.observe(decode_time / (self._num_tokens - 1))
            m.request_prompt_tokens.observe(self._num_prompt_tokens)
            m.request_generation_tokens.observe(self._num_tokens)
