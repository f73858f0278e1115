"""The default deployment's shape, one prefill and one decode replica (deploy/local.yaml), losing
either of them mid-request: there is no other replica of the stage to migrate to, so the requests
it held, and those that arrive meanwhile, wait for its replacement and go on there (token for
token, the unfaulted greedy output); none is lost and every pool ends free. Where the replacement
does not come back within the router's queue timeout they end with an error that names the
stage and the replica (tests/cluster/test_router.py)."""
from __future__ import annotations

import signal
import time

import pytest

from cluster.bench.chaos import HEALTH, http_stream, metric, signal_replica
from tests.chaos.test_chaos import GREEDY, LONG_PROMPTS, PROMPTS, Load, _check, _pools_free, _serving_again
from tests.e2e.conftest import disagg_spec, running_cluster


@pytest.fixture(scope="module")
def cluster(ray_instance):
    with running_cluster(disagg_spec(1, 1, "grpc", health=HEALTH)) as rc:
        yield rc


@pytest.fixture(scope="module")
def reference(cluster):
    """Unfaulted outputs and the cluster's time per output token (texts: `_check` reads them for HTTP)."""
    prompts = PROMPTS[:4] + LONG_PROMPTS[:2]
    t0 = time.monotonic()
    tokens = {p: list(cluster.client.generate(p, **GREEDY).token_ids) for p in prompts}
    per_token = (time.monotonic() - t0) / (len(tokens) * GREEDY["max_tokens"])
    texts = {p: http_stream(cluster.http_port, p, GREEDY)[0] for p in prompts}
    return tokens, texts, per_token


@pytest.mark.parametrize("stage", ["decode", "prefill"])
def test_the_only_replica_of_a_stage_killed_mid_request_loses_no_request(cluster, reference, stage):
    lost = metric(cluster, "kvrelay_requests_lost_total")
    prompts = PROMPTS[:4] if stage == "decode" else LONG_PROMPTS[:2]
    load = Load(cluster, prompts)
    if stage == "decode":
        load.wait_streaming(cluster, min_running=len(prompts), decodes=("decode-0",))
    else:
        time.sleep(0.3)  # the long prompts are queued, computing or transferring
    t_fault = time.monotonic()
    signal_replica(cluster, f"{stage}-0", signal.SIGKILL)
    late = Load(cluster, prompts[:1])  # arrives while the replica is being replaced
    load.join()
    late.join()
    # each ends within the replacement's start (a model load) plus its remaining decode (and prompt)
    _check(load, reference, t_fault, bound_s=30.0)
    _check(late, reference, t_fault, bound_s=30.0)
    assert metric(cluster, "kvrelay_requests_lost_total") == lost
    _serving_again(cluster, f"{stage}-0")
    _pools_free(cluster)
