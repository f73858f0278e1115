"""Clusters started from spec dicts on the session's local Ray instance
(`ray_instance`, tests/conftest.py), served on loopback."""
from __future__ import annotations

from cluster.bench.inprocess import RunningCluster, running_cluster  # noqa: F401  (the tests' way in)

# Replicas ask for a slice of a CPU so several fit on a 2-core machine.
SLICE = {"num_cpus": 0.25}


def disagg_spec(prefill: int = 2, decode: int = 2, backend: str = "grpc", **extra) -> dict:
    spec = {
        "mode": "disaggregated",
        "prefill": {"replicas": prefill, "resources": SLICE, "num_kv_blocks": 192, "max_num_batched_tokens": 512},
        "decode": {"replicas": decode, "resources": SLICE, "num_kv_blocks": 192},
        "transfer": {"backend": backend, "options": {"lease_s": 20, "deadline_s": 30}},
    }
    for k, v in extra.items():
        spec[k] = dict(spec.get(k, {}), **v) if isinstance(v, dict) else v
    return spec


def colocated_spec(replicas: int = 2, **extra) -> dict:
    spec = {"mode": "colocated",
            "colocated": {"replicas": replicas, "resources": SLICE, "num_kv_blocks": 192,
                          "max_num_batched_tokens": 512}}
    for k, v in extra.items():
        spec[k] = dict(spec.get(k, {}), **v) if isinstance(v, dict) else v
    return spec
