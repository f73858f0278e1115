"""Faults at scale: a steady streaming load on a served cluster while replicas
are killed, stopped and cut off, one fault after another.

    python -m cluster.bench.chaos [--requests 1000] [--concurrency 16] [--replicas 2] [--write]

The cluster (2 prefill + 2 decode replicas, grpc transfer, the default
model; `--replicas 1`: one of each, deploy/local.yaml's shape, where a
faulted replica's requests wait for its replacement) runs in this process on a local Ray instance, so the benchmark can
reach the replicas' processes; clients stream over gRPC and HTTP (half
each). Every output is checked against the unfaulted greedy output of its
prompt. Per fault it reports the requests in flight at the fault, how they
ended (finished, failed by code, hung, wrong), the requests migrated, the
time from the fault to each affected request's end beyond its own
remaining decode time (p99, max), and the time until the faulted replica
served again; at the end, the KV blocks still held on any replica.

`tests/chaos` drives the same faults and load, bounded to a few minutes.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import statistics
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

SECTION = "## Chaos"
SECTION_ONE = "## Chaos, one replica a stage"  # --replicas 1
PROMPTS = [f"Question {i}: tell me about the {w}." for i, w in enumerate(
    ["sea", "moon", "desert", "forest", "river", "mountain", "city", "sky", "rain", "snow", "wind", "fire",
     "stars", "clouds", "islands", "caves"])]
HEALTH = {"heartbeat_timeout_s": 1.0, "replace_after_s": 4.0, "restart_backoff_s": 0.2}


def chaos_spec(max_tokens_budget: int = 512, replicas: int = 2) -> dict:
    slice_ = {"num_cpus": 0.25}
    return {"mode": "disaggregated", "dtype": "float32", "frontend": {"grpc_port": 0, "http_port": 0},
            "prefill": {"replicas": replicas, "resources": slice_, "num_kv_blocks": 192,
                        "max_num_batched_tokens": max_tokens_budget},
            "decode": {"replicas": replicas, "resources": slice_, "num_kv_blocks": 192},
            "transfer": {"backend": "grpc", "options": {"lease_s": 20, "deadline_s": 30}},
            "router": {"policy": "round_robin"}, "health": dict(HEALTH)}


# ---- faults -------------------------------------------------------------------
def replica_pid(cluster, replica_id: str) -> int:
    import ray

    return ray.get(cluster.actor(replica_id).__ray_call__.remote(lambda self: os.getpid()), timeout=30)


def signal_replica(cluster, replica_id: str, sig: int, resume_after_s: float | None = None) -> None:
    """Send ``sig`` to the replica's process (SIGCONT it ``resume_after_s`` later)."""
    pid = replica_pid(cluster, replica_id)
    os.kill(pid, sig)
    if resume_after_s is not None:
        threading.Timer(resume_after_s, _cont, (pid,)).start()


def _cont(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:  # replaced (killed) meanwhile
        pass


def cut_channel(cluster, replica_id: str) -> None:
    """Break the replica's request channel from the frontend's side (a network fault)."""
    async def cut():
        cluster.cluster.backend.channels.drop(replica_id)
    cluster.run(cut())


def cut_transfers(cluster, replica_id: str) -> None:
    """Close the prefill replica's KV transfer links under the transfers in flight."""
    def close_links(stage):
        for link in list(stage.sender._links.values()):
            link.close()
    cluster.actor(replica_id).__ray_call__.remote(close_links)


FAULTS = {  # name -> (replica, inject)
    "SIGKILL decode": ("decode-0", lambda c, r: signal_replica(c, r, signal.SIGKILL)),
    "SIGSTOP decode 8 s (replaced)": ("decode-1", lambda c, r: signal_replica(c, r, signal.SIGSTOP, 8.0)),
    "SIGKILL prefill": ("prefill-0", lambda c, r: signal_replica(c, r, signal.SIGKILL)),
    "SIGSTOP prefill 2.5 s (back)": ("prefill-1", lambda c, r: signal_replica(c, r, signal.SIGSTOP, 2.5)),
    "channel cut decode": ("decode-0", cut_channel),
    "transfer cut prefill": ("prefill-1", cut_transfers),
}


def faults_on(replicas: int) -> dict:
    """FAULTS on a cluster of ``replicas`` replicas a stage (with one, every fault hits replica 0)."""
    return {name: (r if replicas > 1 else r[:-1] + "0", inject) for name, (r, inject) in FAULTS.items()}


# ---- load ---------------------------------------------------------------------
def http_stream(http_port: int, prompt: str, params: dict, on_token=None) -> tuple[str, int]:
    """A streamed /v1/completions request: (text, HTTP status; 503 for an in-stream unavailable error)."""
    body = json.dumps(dict(model="", prompt=prompt, stream=True, **params)).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{http_port}/v1/completions", body,
                                 {"content-type": "application/json"})
    text = []
    try:
        with urllib.request.urlopen(req, timeout=300) as resp:
            for line in resp:
                line = line.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return "".join(text), 503 if "unavailable" in json.dumps(event).lower() else 500
                for c in event.get("choices", []):
                    if c.get("text"):
                        text.append(c["text"])
                        if on_token is not None:
                            on_token()
            return "".join(text), resp.status
    except urllib.error.HTTPError as e:
        return "".join(text), e.code


@dataclass
class Outcome:
    prompt: str
    via: str  # "grpc" | "http"
    start: float
    end: float | None = None
    result: object = None  # token ids (grpc) or text (http); None if it failed
    code: str = "ok"  # "ok", a gRPC status name, or "http <status>"
    progress: list[float] = field(default_factory=list)  # when each token (or text chunk) came


def run_one(cluster, prompt: str, via: str, params: dict) -> Outcome:
    from cluster.client import KVRelayError

    o = Outcome(prompt, via, time.monotonic())
    try:
        if via == "grpc":
            out = []
            for c in cluster.client.stream(prompt, **params):
                out.extend(c.token_ids)
                o.progress.extend([time.monotonic()] * len(c.token_ids))
            o.result = out
        else:
            text, status = http_stream(cluster.http_port, prompt, params, lambda: o.progress.append(time.monotonic()))
            o.result, o.code = text, "ok" if status == 200 else f"http {status}"
    except KVRelayError as e:
        o.code = e.code.name
    o.end = time.monotonic()
    return o


def is_right(o: Outcome, reference: dict) -> bool:
    tokens, texts = reference
    return o.result == (tokens if o.via == "grpc" else texts)[o.prompt]


# ---- the run ------------------------------------------------------------------
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--fault-interval-s", type=float, default=20.0, help="seconds between faults")
    p.add_argument("--replicas", type=int, choices=(1, 2), default=2, help="prefill and decode replicas each")
    p.add_argument("--write", action="store_true", help=f"replace the '{SECTION}' section of BENCHMARKS.md "
                   f"('{SECTION_ONE}' with --replicas 1)")
    args = p.parse_args(argv)

    import ray

    from cluster.bench.inprocess import running_cluster

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    params = dict(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    with running_cluster(chaos_spec(replicas=args.replicas)) as cluster:
        reference = ({q: list(cluster.client.generate(q, **params).token_ids) for q in PROMPTS},
                     {q: http_stream(cluster.http_port, q, params)[0] for q in PROMPTS})
        outcomes: list[Outcome] = []
        lock = threading.Lock()
        next_i = [0]

        def worker():
            while True:
                with lock:
                    i = next_i[0]
                    if i >= args.requests:
                        return
                    next_i[0] += 1
                o = run_one(cluster, PROMPTS[i % len(PROMPTS)], "grpc" if i % 2 == 0 else "http", params)
                with lock:
                    outcomes.append(o)

        started = time.monotonic()
        threads = [threading.Thread(target=worker, daemon=True) for _ in range(args.concurrency)]
        for t in threads:
            t.start()
        interval = args.fault_interval_s
        faults = []  # (name, replica, time, time serving again, migrations during)
        for name, (replica, inject) in faults_on(args.replicas).items():
            time.sleep(interval / 2)
            if next_i[0] >= args.requests:
                break
            m0 = metric(cluster, "kvrelay_request_migrations_total")
            at = time.monotonic()
            inject(cluster, replica)
            back = _back_after(cluster, replica, at)
            time.sleep(interval / 2)
            faults.append((name, replica, at, back, metric(cluster, "kvrelay_request_migrations_total") - m0))
        for t in threads:
            t.join(900)
        hung = sum(t.is_alive() for t in threads)
        wall = time.monotonic() - started
        leaked = {rid: free for rid, free in cluster.wait_pools_free(timeout_s=60).items() if not free}
        lost = metric(cluster, "kvrelay_requests_lost_total")
    ray.shutdown()
    # the time per token under this load, unfaulted: requests that ended before the first fault
    first_fault = faults[0][2] if faults else float("inf")
    gaps = [(o.progress[-1] - o.progress[0]) / (len(o.progress) - 1) for o in outcomes
            if o.end is not None and o.end < first_fault and len(o.progress) > 1]
    per_token = statistics.median(gaps) if gaps else float("nan")
    table = report(outcomes, faults, reference, args, per_token, hung, leaked, lost, wall)
    print(table)
    if args.write:
        from engine.benchmarks_md import write_section

        write_section(table)
    return 0


def _back_after(cluster, replica_id: str, since: float, timeout_s: float = 120) -> float | None:
    """When the replica served again after the fault took it out of the router
    (None if it never left: the fault did not need it to)."""
    def serving() -> bool:
        st = {r.replica_id: r for r in cluster.client.status().replicas}[replica_id]
        return st.is_alive and st.state == "serving"
    left_by = since + HEALTH["heartbeat_timeout_s"] + 2.0
    while serving():
        if time.monotonic() > left_by:
            return None
        time.sleep(0.05)
    while time.monotonic() < since + timeout_s:
        if serving():
            return time.monotonic()
        time.sleep(0.1)
    return float("inf")


def metric(cluster, name: str) -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{cluster.http_port}/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in body.splitlines() if line.startswith(name))


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def report(outcomes, faults, reference, args, per_token, hung, leaked, lost, wall) -> str:
    rows = []
    for name, replica, at, back, migrated in faults:
        hit = [o for o in outcomes if o.start <= at and (o.end is None or o.end >= at)]
        ok = [o for o in hit if o.code == "ok" and is_right(o, reference)]
        wrong = [o for o in hit if o.code == "ok" and not is_right(o, reference)]
        failed: dict[str, int] = {}
        for o in hit:
            if o.code != "ok":
                failed[o.code] = failed.get(o.code, 0) + 1
        beyond = [(o.end - at) - (args.max_tokens - sum(t <= at for t in o.progress)) * per_token for o in hit]
        rows.append(f"| {name} ({replica}) | {len(hit)} | {len(ok)} | {migrated:.0f} | "
                    f"{', '.join(f'{k} {v}' for k, v in sorted(failed.items())) or '0'} | {len(wrong)} | "
                    f"{_pct(beyond, 0.99):.2f} / {max(beyond, default=float('nan')):.2f} | "
                    f"{'not taken out' if back is None else f'{back - at:.1f}'} |")
    total_wrong = sum(o.code == "ok" and not is_right(o, reference) for o in outcomes)
    total_failed = sum(o.code != "ok" for o in outcomes)
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    isa = "AVX-512 BF16" if "avx512_bf16" in open("/proc/cpuinfo").read() else "AVX2"
    return f"""{SECTION if args.replicas > 1 else SECTION_ONE}

{len(outcomes)} streaming requests ({args.max_tokens} greedy tokens each, half gRPC, half HTTP, {args.concurrency}
at a time) on {args.replicas} prefill + {args.replicas} decode replica{'s' if args.replicas > 1 else ''} (the default model, fp32, grpc transfer), with one fault after
another; every output checked against its prompt's unfaulted greedy output (tokens over gRPC, text over HTTP).
"In flight" counts every request running at the fault, on the faulted replica or not; "beyond" is the time
from the fault to the request's end minus its own remaining decode time (tokens left × {per_token * 1000:.0f} ms,
the median time per token of the requests that ended before the first fault); "serving again" is from the
fault to the replica's return to the router (replaced, or back from a stop).

| fault (replica) | in flight | finished right | migrated | failed (by code) | wrong | beyond, p99 / max (s) | serving again after (s) |
|---|---|---|---|---|---|---|---|
{chr(10).join(rows)}

Whole run: {len(outcomes)} sent, {len(outcomes) - total_failed - total_wrong} finished right, {total_failed} failed,
{total_wrong} wrong, {hung} hung, {lost:.0f} lost (kvrelay_requests_lost_total), KV blocks held after
quiescence: {'none' if not leaked else leaked}; {wall:.0f} s.

- Command: `python -m cluster.bench.chaos --requests {args.requests} --concurrency {args.concurrency}{f' --replicas {args.replicas}' if args.replicas != 2 else ''} --write`
- Date: {now}
- Machine: `nproc` {os.cpu_count()}, {platform.processor() or platform.machine()}, {isa}, Python {platform.python_version()}
"""


if __name__ == "__main__":
    raise SystemExit(main())
