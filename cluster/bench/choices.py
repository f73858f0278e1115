"""n > 1 on a disaggregated cluster (one transfer) against n separate requests, in one run:

    python -m cluster.bench.choices [--prompt-tokens 512] [--n 4] [--max-tokens 32] [--dtype auto]

One prefill and one decode replica (the grpc transport) on a local Ray
instance started here, prefill's prefix cache off (so a repeated prompt is
computed again, as n separate requests of distinct users' prompts would
be). The same prompt as one request with n choices, and as n concurrent
requests: the wall time, and from the cluster's /metrics the prompt tokens
each stage computed and the KV bytes the prefill replica sent.
"""
from __future__ import annotations

import argparse
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

COUNTERS = ("kvrelay_replica_prompt_tokens_computed_total", "kvrelay_replica_kv_sent_bytes_total")


def _counters(port: int) -> dict[tuple[str, str], float]:
    """(counter, stage) -> value, summed over the stage's replicas."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        text = r.read().decode()
    out: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in COUNTERS:
                key = (s.name, s.labels["stage"])
                out[key] = out.get(key, 0.0) + s.value
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()

    import openai
    import ray

    from cluster.bench.inprocess import running_cluster

    ray.init(include_dashboard=False, log_to_driver=False)
    spec = {"mode": "disaggregated", "dtype": args.dtype,
            "prefill": {"replicas": 1, "num_kv_blocks": 512, "enable_prefix_caching": False},
            "decode": {"replicas": 1, "num_kv_blocks": 512},
            "transfer": {"backend": "grpc"}}
    prompt = [(i * 7919) % 40000 + 100 for i in range(args.prompt_tokens)]
    with running_cluster(spec) as rc:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{rc.http_port}/v1", api_key="unused", max_retries=0,
                               timeout=600)
        model = client.models.list().data[0].id

        def complete(n: int):
            return client.completions.create(model=model, prompt=prompt, n=n, max_tokens=args.max_tokens,
                                             temperature=0, extra_body={"ignore_eos": True})

        def measure(fn) -> tuple[float, dict]:
            rc.wait_pools_free()
            time.sleep(0.5)  # the replicas report their counters every 50 ms
            before = _counters(rc.http_port)
            t0 = time.perf_counter()
            fn()
            wall = time.perf_counter() - t0
            rc.wait_pools_free()
            time.sleep(0.5)
            after = _counters(rc.http_port)
            return wall, {k: v - before.get(k, 0.0) for k, v in after.items()}

        complete(1)  # warm-up
        with ThreadPoolExecutor(args.n) as pool:
            separate = measure(lambda: list(pool.map(lambda _: complete(1), range(args.n))))
        forked = measure(lambda: complete(args.n))
    ray.shutdown()

    tokens, sent = COUNTERS
    print(f"n={args.n}, prompt {args.prompt_tokens} tokens, {args.max_tokens} new each, dtype {args.dtype}:")
    print("| what | one request, n choices | n separate requests | ratio |")
    print("| --- | --- | --- | --- |")
    for label, key in (("prompt tokens computed, prefill replica", (tokens, "prefill")),
                       ("prompt tokens computed, decode replica", (tokens, "decode")),
                       ("KV bytes sent", (sent, "prefill"))):
        a, b = forked[1].get(key, 0.0), separate[1].get(key, 0.0)
        print(f"| {label} | {a:.0f} | {b:.0f} | {a / b:.2f} |" if b else f"| {label} | {a:.0f} | {b:.0f} | - |")
    print(f"| wall time | {forked[0]:.2f} s | {separate[0]:.2f} s | {forked[0] / separate[0]:.2f} |")


if __name__ == "__main__":
    main()
