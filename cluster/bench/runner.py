"""Drives a benchmark: warmup, then one run per request rate.

A run's life cycle:

1. schedule  every request gets a send time from the arrival process
2. issue     at its time (and, under ``max_concurrency``, once a slot frees)
             each request becomes a task that streams and fills its record;
             with a ``duration_s`` cap nothing is issued after the cap
3. drain     wait for the tasks; with a cap, at most ``grace_s`` past it
4. cancel    tasks still running are cancelled and recorded as errors
             (``CANCELLED``), so a run always ends when capped
5. summarize `stats.summarize` over the records

Each rate gets fresh prompts with the same lengths (random workloads), so a
server's prefix cache does not carry one rate's prompts into the next; a
dataset's prompts repeat across rates. Warmup requests are sent at once
before the first rate, with their own prompts, and are kept out of the stats.
"""
from __future__ import annotations

import asyncio
import math
import sys
import time
from dataclasses import dataclass, field
from typing import TextIO

from cluster.bench.clients import BenchError, GrpcSender, OpenAISender, Sender, ServerInfo
from cluster.bench.stats import ATTAINMENT_TARGET, RequestRecord, Slo, max_rate_at_attainment, summarize
from cluster.bench.workload import RequestSpec, WorkloadError, dataset_requests, random_requests, arrival_offsets
from engine.serving.timeouts import within


@dataclass
class BenchConfig:
    backend: str = "kvrelay"  # "kvrelay" (gRPC) or "openai" (HTTP)
    target: str = "127.0.0.1:50051"  # gRPC host:port
    base_url: str = "http://127.0.0.1:8000/v1"  # OpenAI-compatible API root
    api_key: str | None = None
    tls: bool = False
    root_certs: str | None = None
    model: str = ""
    num_prompts: int = 100
    input_len: int = 256
    output_len: int = 128
    range_ratio: float = 0.0
    dataset: str | None = None
    ignore_eos: bool = True
    temperature: float | None = None
    seed: int = 0
    rates: list[float] = field(default_factory=lambda: [math.inf])
    burstiness: float = 1.0
    max_concurrency: int | None = None
    warmup: int = 0
    duration_s: float | None = None
    grace_s: float = 10.0
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    label: str | None = None

    def check(self) -> None:
        problems = []
        if self.backend not in ("kvrelay", "openai"):
            problems.append(f"--backend must be kvrelay or openai, got {self.backend!r}")
        if self.num_prompts < 1:
            problems.append(f"--num-prompts must be >= 1, got {self.num_prompts}")
        if self.warmup < 0:
            problems.append(f"--warmup must be >= 0, got {self.warmup}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            problems.append(f"--max-concurrency must be >= 1, got {self.max_concurrency}")
        if self.duration_s is not None and not self.duration_s > 0:
            problems.append(f"--duration-s must be > 0, got {self.duration_s}")
        if self.grace_s < 0:
            problems.append(f"--grace-s must be >= 0, got {self.grace_s}")
        if not self.rates or any(not r > 0 for r in self.rates):
            problems.append(f"request rates must be > 0 (or inf), got {self.rates}")
        if problems:
            raise WorkloadError("; ".join(problems))


@dataclass
class RateRun:
    request_rate: float
    records: list[RequestRecord]
    summary: dict


@dataclass
class BenchResult:
    config: BenchConfig
    server: ServerInfo
    warmup_records: list[RequestRecord]
    runs: list[RateRun]
    max_rate_at_90pct_attainment: float | None


class Progress:
    """One stderr line, rewritten as requests finish: done/total, failures, completion rate."""

    def __init__(self, label: str, total: int, stream: TextIO | None = sys.stderr, interval_s: float = 0.2):
        self.label, self.total, self.stream, self.interval_s = label, total, stream, interval_s
        self.num_done = self.num_failed = 0
        self.t0 = self._last = time.perf_counter()

    def update(self, rec: RequestRecord) -> None:
        self.num_done += 1
        self.num_failed += not rec.is_ok
        now = time.perf_counter()
        if now - self._last >= self.interval_s or self.num_done == self.total:
            self._last = now
            self._write("\r")

    def _write(self, prefix: str) -> None:
        if self.stream is None:
            return
        elapsed = time.perf_counter() - self.t0
        rate = self.num_done / elapsed if elapsed > 0 else 0.0
        self.stream.write(f"{prefix}{self.label}: {self.num_done}/{self.total} done, {self.num_failed} failed, "
                          f"{rate:.2f} req/s, {elapsed:.1f}s")
        self.stream.flush()


async def run_requests(sender: Sender, specs: list[RequestSpec], offsets: list[float], *,
                       max_concurrency: int | None = None, duration_s: float | None = None,
                       grace_s: float = 10.0, progress: Progress | None = None) -> list[RequestRecord]:
    """Send ``specs`` at ``offsets`` (seconds from now); one record per spec, unsent ones with start_s None."""
    records = [RequestRecord(s.index, s.prompt_len, s.output_len, scheduled_s=t) for s, t in zip(specs, offsets)]
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    t0 = time.perf_counter()

    def clock() -> float:
        return time.perf_counter() - t0

    async def one(spec: RequestSpec, rec: RequestRecord) -> None:
        try:
            rec.start_s = clock()
            await sender.send(spec, rec, clock)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug or an unexpected client failure: keep the run going, record it
            rec.is_ok, rec.error_code, rec.error_message = False, "CLIENT_ERROR", f"{type(e).__name__}: {e}"
            rec.end_s = clock()
        finally:
            if slots is not None:
                slots.release()
            if progress is not None and rec.end_s is not None:
                progress.update(rec)

    tasks: list[asyncio.Task] = []
    for spec, rec in zip(specs, records):
        if duration_s is not None and rec.scheduled_s >= duration_s:
            break
        delay = rec.scheduled_s - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        if slots is not None:
            left = None if duration_s is None else duration_s - clock()
            try:
                await within(slots.acquire(), left)
            except asyncio.TimeoutError:
                break
        tasks.append(asyncio.create_task(one(spec, rec)))

    pending: set[asyncio.Task] = set(tasks)
    if pending:
        timeout = None if duration_s is None else max(0.0, duration_s + grace_s - clock())
        _, pending = await asyncio.wait(pending, timeout=timeout)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    now = clock()
    for rec in records:
        if rec.start_s is not None and rec.end_s is None:
            rec.is_ok, rec.error_code, rec.end_s = False, "CANCELLED", now
            rec.error_message = f"still running {grace_s:g}s after the {duration_s:g}s duration cap"
            if progress is not None:
                progress.update(rec)
    return records


def make_sender(c: BenchConfig) -> Sender:
    if c.backend == "openai":
        return OpenAISender(c.base_url, api_key=c.api_key, model=c.model, temperature=c.temperature,
                            ignore_eos=c.ignore_eos)
    return GrpcSender(c.target, api_key=c.api_key, tls=c.tls, root_certificates=c.root_certs, model=c.model,
                      temperature=c.temperature, ignore_eos=c.ignore_eos)


def make_requests(c: BenchConfig, server: ServerInfo, num: int, variant: int) -> list[RequestSpec]:
    """The workload for one run; ``variant`` changes random prompts' content, not their lengths."""
    if c.dataset:
        return dataset_requests(c.dataset, num, c.output_len, c.seed + variant)
    vocab = server.vocab_size if c.backend == "kvrelay" else None
    specs = random_requests(num, c.input_len, c.output_len, c.range_ratio, c.seed, vocab, variant)
    longest = max(s.prompt_len + s.output_len for s in specs)
    if server.max_model_len and longest > server.max_model_len:
        raise WorkloadError(f"prompts and outputs of up to {longest} tokens do not fit the served context of "
                            f"{server.max_model_len}; lower --input-len/--output-len/--range-ratio")
    return specs


def rate_name(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


async def run_bench(c: BenchConfig, sender: Sender | None = None, progress_stream: TextIO | None = sys.stderr
                    ) -> BenchResult:
    """Warm up, run every rate of ``c.rates`` in order, and summarize."""
    c.check()
    sender = sender or make_sender(c)
    slo = Slo(c.slo_ttft_ms, c.slo_tpot_ms)
    try:
        server = await sender.setup()
        warmup: list[RequestRecord] = []
        if c.warmup:
            specs = make_requests(c, server, c.warmup, variant=0)
            warmup = await run_requests(sender, specs, [0.0] * len(specs), max_concurrency=c.max_concurrency,
                                        duration_s=c.duration_s, grace_s=c.grace_s,
                                        progress=Progress("warmup", len(specs), progress_stream))
            _finish(progress_stream)
        runs = []
        for i, rate in enumerate(c.rates):
            specs = make_requests(c, server, c.num_prompts, variant=i + 1)
            offsets = arrival_offsets(len(specs), rate, c.burstiness, c.seed + i)
            progress = Progress(f"rate {rate_name(rate)}/s", len(specs), progress_stream)
            records = await run_requests(sender, specs, offsets, max_concurrency=c.max_concurrency,
                                         duration_s=c.duration_s, grace_s=c.grace_s, progress=progress)
            _finish(progress_stream)
            runs.append(RateRun(rate, records, summarize(records, slo)))
    finally:
        await sender.close()
    best = max_rate_at_attainment([(r.request_rate, r.summary["slo_attainment"]) for r in runs], ATTAINMENT_TARGET)
    return BenchResult(c, server, warmup, runs, best)


def _finish(stream: TextIO | None) -> None:
    if stream is not None:
        stream.write("\n")
        stream.flush()


__all__ = ["BenchConfig", "BenchError", "BenchResult", "Progress", "RateRun", "make_sender", "run_bench",
           "run_requests"]
