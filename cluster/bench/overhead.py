"""What the cluster adds on top of the engine, measured in one run.

    python -m cluster.bench.overhead [--dtype bfloat16] [--write]

1. One request, streamed: time to first token and inter-token latency with
   `engine.LLM` in this process, then through a running cluster over gRPC
   (disaggregated 1 prefill + 1 decode over the grpc transport, and
   colocated); the TTFT the cluster adds beyond computing the prompt comes
   from each request's timeline, and the KV transfer time (which the first
   token no longer waits for) from the cluster's own /metrics.
2. 16 concurrent streams: output tokens/s, disaggregated (1P + 1D) vs
   colocated (2 replicas), on the same CPUs.

Each cluster is `kvrelay serve` in a process of its own, with its own local
Ray instance; this process is only the client, as a user's would be.
"""
from __future__ import annotations

import argparse
import statistics
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

PROMPT = "Describe the water cycle in detail, step by step, for a school science class."


def _stream_times(chunks) -> tuple[float, list[float], float]:
    """TTFT, inter-token gaps, and (cluster only) the TTFT the cluster added
    beyond computing the prompt, from the request timeline. (Disaggregated,
    the first token goes to the client from the prefill replica without
    waiting for the KV transfer, so the transfer is not part of the TTFT.)"""
    t0 = time.perf_counter()
    stamps = []
    timeline = None
    for c in chunks:
        k = len(c.token_ids if hasattr(c, "token_ids") else c.delta_token_ids)
        if k:
            stamps.append(time.perf_counter())
        timeline = getattr(c, "timeline", None) or timeline
    ttft = stamps[0] - t0
    itl = [b - a for a, b in zip(stamps, stamps[1:])]
    added = float("nan")
    if timeline is not None and timeline.prefill_start_s is not None:
        added = ttft - (timeline.prefill_end_s - timeline.prefill_start_s)
    return ttft, itl, added


def engine_single(model_dir: str, dtype: str, max_tokens: int, runs: int):
    from engine.llm import LLM
    from engine.sampling import SamplingParams

    llm = LLM(model_dir, dtype=dtype, num_kv_blocks=256, enable_prefix_caching=False)
    ids = llm.tokenizer.encode(llm.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}]),
                               add_special_tokens=False)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    list(llm.stream(ids, params))  # warm-up
    res = [_stream_times(llm.stream(ids, params)) for _ in range(runs)]
    del llm
    return res


class _Served:
    """`kvrelay serve SPEC` in its own process, with its own local Ray
    instance, as a user runs it; the benchmark is only its client."""

    def __init__(self, spec: dict):
        import os
        import re
        import subprocess
        import sys
        import tempfile

        import yaml

        self._spec = tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False)
        yaml.safe_dump(spec, self._spec)
        self._spec.close()
        self.proc = subprocess.Popen([sys.executable, "-m", "cluster", "serve", self._spec.name],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=dict(os.environ, RAY_DEDUP_LOGS="0"))
        ports = {}
        deadline = time.monotonic() + 600
        for line in self.proc.stdout:  # until it prints its endpoints
            for name, pattern in (("grpc", r"gRPC\s+\S+?:(\d+)"), ("http", r"HTTP\s+http://\S+?:(\d+)")):
                m = re.search(pattern, line)
                if m:
                    ports[name] = int(m.group(1))
            if len(ports) == 2 or time.monotonic() > deadline:
                break
        if len(ports) != 2:
            self.close()
            raise RuntimeError(f"kvrelay serve did not come up (exit code {self.proc.returncode})")
        threading.Thread(target=lambda: [None for _ in self.proc.stdout], daemon=True).start()  # keep it drained
        self.target = f"127.0.0.1:{ports['grpc']}"
        self.http = f"http://127.0.0.1:{ports['http']}"

    def metric_sum(self, name: str) -> tuple[float, float]:
        text = urllib.request.urlopen(f"{self.http}/metrics", timeout=10).read().decode()
        vals = {}
        for line in text.splitlines():
            for suffix in ("_sum", "_count"):
                if line.startswith(name + suffix):
                    vals[suffix] = float(line.split()[-1])
        return vals.get("_sum", 0.0), vals.get("_count", 0.0)

    def close(self):
        import os
        import signal

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # a clean shutdown, as Ctrl-C
            try:
                self.proc.wait(120)
            except Exception:
                self.proc.kill()
        os.unlink(self._spec.name)


def cluster_runs(spec: dict, max_tokens: int, runs: int, concurrent: int):
    from cluster.client import KVRelayClient

    served = _Served(spec)
    try:
        client = KVRelayClient(served.target, timeout=600)
        msgs = [{"role": "user", "content": PROMPT}]
        kw = dict(messages=msgs, max_tokens=max_tokens, temperature=0, ignore_eos=True, timeline=True)
        list(client.stream(**kw))  # warm-up
        xfer0 = served.metric_sum("kvrelay_kv_transfer_time_seconds")
        single = [_stream_times(client.stream(**kw)) for _ in range(runs)]
        xfer1 = served.metric_sum("kvrelay_kv_transfer_time_seconds")
        transfer_s = (xfer1[0] - xfer0[0]) / max(1.0, xfer1[1] - xfer0[1])

        def one(i):
            m = [{"role": "user", "content": f"({i}) {PROMPT}"}]
            return client.generate(messages=m, max_tokens=max_tokens, temperature=0, ignore_eos=True)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(concurrent) as pool:
            outs = list(pool.map(one, range(concurrent)))
        elapsed = time.perf_counter() - t0
        tput = sum(len(o.token_ids) for o in outs) / elapsed
        return single, transfer_s, tput
    finally:
        served.close()


def _summ(runs):
    ttft = statistics.median(r[0] for r in runs) * 1000
    itl = statistics.median(statistics.mean(r[1]) for r in runs) * 1000
    added = statistics.median(r[2] for r in runs) * 1000
    return ttft, itl, added


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--concurrent", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads for the in-process engine; each replica gets one CPU, so 1 compares like with like")
    ap.add_argument("--write", action="store_true", help="replace '## Cluster overhead' in BENCHMARKS.md")
    args = ap.parse_args(argv)

    from engine.weights import resolve_model

    model_dir = str(resolve_model(None))
    import torch
    torch.set_num_threads(args.threads)
    eng = _summ(engine_single(model_dir, args.dtype, args.max_tokens, args.runs))
    one = {"num_cpus": 1}
    base = {"dtype": args.dtype, "frontend": {"host": "127.0.0.1", "grpc_port": 0, "http_port": 0}}
    dis_spec = dict(base, mode="disaggregated", transfer={"backend": "grpc"},
                    prefill={"replicas": 1, "resources": one, "num_kv_blocks": 512, "enable_prefix_caching": False},
                    decode={"replicas": 1, "resources": one, "num_kv_blocks": 1024, "enable_prefix_caching": False})
    col_spec = dict(base, mode="colocated",
                    colocated={"replicas": 2, "resources": one, "num_kv_blocks": 1024,
                               "enable_prefix_caching": False})
    dis_single, xfer, dis_tput = cluster_runs(dis_spec, args.max_tokens, args.runs, args.concurrent)
    col_single, _, col_tput = cluster_runs(col_spec, args.max_tokens, args.runs, args.concurrent)
    dis, col = _summ(dis_single), _summ(col_single)
    rows = [
        ("TTFT, one request (ms)", f"{eng[0]:.1f}", f"{dis[0]:.1f}", f"{col[0]:.1f}"),
        ("  added beyond prompt compute (ms)", "-", f"{dis[2]:.1f}", f"{col[2]:.1f}"),
        ("  KV transfer after prefill, off the TTFT path (ms)", "-", f"{xfer * 1000:.1f}", "-"),
        ("ITL, one request (ms/token)", f"{eng[1]:.2f}", f"{dis[1]:.2f}", f"{col[1]:.2f}"),
        ("  added per token (ms)", "-", f"{dis[1] - eng[1]:.2f}", f"{col[1] - eng[1]:.2f}"),
        (f"output tokens/s, {args.concurrent} concurrent streams", "-", f"{dis_tput:.1f}", f"{col_tput:.1f}"),
    ]
    table = ["| metric | engine.LLM | disaggregated 1P+1D (grpc) | colocated x2 |", "|---|---|---|---|"]
    table += [f"| {' | '.join(r)} |" for r in rows]
    text = "\n".join(table)
    print(text)
    if args.write:
        import sys

        from engine.benchmarks_md import provenance, write_section

        cmd = "python -m cluster.bench.overhead " + " ".join(sys.argv[1:] if argv is None else argv)
        body = (f"## Cluster overhead\n\nOne chat request (~40 prompt tokens, {args.max_tokens} new tokens, greedy, "
                f"{args.dtype}) streamed through `engine.LLM` in-process ({args.threads} torch thread(s)) and through running clusters over gRPC; "
                f"then {args.concurrent} concurrent streams. Each cluster is `kvrelay serve` in its own process "
                f"(the benchmark is only the client). Disaggregated: 1 prefill + 1 decode replica, one CPU "
                f"each; colocated: 2 replicas, one CPU each.\n\n{text}\n\n{provenance(cmd)}\n")
        write_section(body)


if __name__ == "__main__":
    main()
