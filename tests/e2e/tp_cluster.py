"""What the tensor-parallel e2e tests share: a tiny random checkpoint with a real tokenizer,
its engine.LLM TP=1 reference, a cluster of two colocated TP=2 replicas on the session's Ray
(its leak check at the end: placement groups, rank processes, segments), small probes, and
the check of a parallel replica's prompt logprobs against one rank's."""
from __future__ import annotations

import os
import time

import pytest

from cluster.bench.chaos import HEALTH
from engine.llm import LLM
from engine.parallel.shm import SEGMENT_PREFIX, SHM_DIR
from engine.sampling import SamplingParams
from tests.e2e.conftest import SLICE, running_cluster
from tests.engine.factories import random_prompts, save_tiny_model_with_tokenizer

MAX_TOKENS = 12
NUM_REQUESTS = 16


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, default_model_dir):
    """A tiny random llama (4 heads, 2 KV heads) with the default model's tokenizer."""
    folder = tmp_path_factory.mktemp("tiny-tp")
    save_tiny_model_with_tokenizer(folder, default_model_dir)
    return folder


@pytest.fixture(scope="module")
def prompts(tiny_model):
    return random_prompts(NUM_REQUESTS, 2000, [5, 19, 33, 40])


LONG = dict(max_tokens=100, temperature=0, ignore_eos=True)  # the streams a rank dies under
NUM_LONG = 8


@pytest.fixture(scope="module")
def reference(tiny_model, prompts):
    """engine.LLM at TP=1, greedy fp32: the 16 requests, and the first 8 at LONG."""
    llm = LLM(str(tiny_model), dtype="float32", num_kv_blocks=128)
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    long = llm.generate(prompts[:NUM_LONG], SamplingParams(**LONG))
    assert llm.core.pool.is_fully_free()
    return [o.token_ids for o in outs], [o.token_ids for o in long]


TP_TIMEOUT_S = 5.0  # a collective that waits longer fails the replica


def tp_spec(model, replicas: int = 2, tp: int = 2, **stage) -> dict:
    return {"model": str(model), "mode": "colocated", "router": {"policy": "round_robin"}, "health": HEALTH,
            "colocated": dict({"replicas": replicas, "tensor_parallel_size": tp, "resources": SLICE,
                               "tp_timeout_s": TP_TIMEOUT_S,
                               "num_kv_blocks": 64, "max_num_batched_tokens": 256}, **stage)}


def placement_groups() -> list[dict]:
    import ray

    return [g for g in ray.util.placement_group_table().values() if g["state"] == "CREATED"]


def segments(pids) -> set[str]:
    """The shared-memory segments that rank 0 processes among ``pids`` created (named by their pid)."""
    mine = {f"{SEGMENT_PREFIX}{p}-" for p in pids}
    return {n for n in os.listdir(SHM_DIR) if n[:n.rfind("-") + 1] in mine}


def is_running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(pids, timeout_s: float = 20.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(is_running(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if is_running(p)]


def rank_pids(rc, rid: str) -> list[int]:
    import ray

    return ray.get(rc.actor(rid).rank_pids.remote(), timeout=30)


def generate(rc, prompt):
    return list(rc.client.generate(token_ids=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                   ignore_eos=True).token_ids)


@pytest.fixture(scope="module")
def served(ray_instance, tiny_model):
    """Two colocated TP=2 replicas; ``rc.seen_pids`` collects every rank process the tests saw
    (`record_ranks`). Once stopped: no placement group, no rank process, no segment left."""
    groups_before = len(placement_groups())
    with running_cluster(tp_spec(tiny_model)) as rc:
        rc.seen_pids = []
        yield rc
    assert len(placement_groups()) == groups_before
    assert wait_gone(rc.seen_pids) == []
    assert segments(rc.seen_pids) == set()


def record_ranks(rc, rid: str) -> list[int]:
    """The replica's rank pids (rank 0 first), remembered for the leak check at the end."""
    pids = rank_pids(rc, rid)
    rc.seen_pids.extend(pids)
    return pids


def scored_reference(model, prompts) -> list[list[dict | None]]:
    """engine.LLM's prompt logprobs (top 2) of prompts[2:4], at PP=1, TP=1 (`check_scored`)."""
    llm = LLM(str(model), dtype="float32", num_kv_blocks=128)
    return [o.prompt_logprobs for o in llm.generate(prompts[2:4], SamplingParams(max_tokens=1, prompt_logprobs=2))]


def check_scored(client, prompts, scored) -> None:
    """What lm-evaluation-harness reads, over gRPC: each prompt token's logprob, rank and top 2, as
    one rank computes them (`scored_reference`)."""
    for prompt, want in zip(prompts[2:4], scored):
        got = client.generate(token_ids=prompt, max_tokens=1, temperature=0, prompt_logprobs=2).prompt_logprobs
        assert [lp.token_id for lp in got] == prompt[1:]
        for lp, w in zip(got, want[1:]):
            assert lp.logprob == pytest.approx(w["token_logprob"], abs=1e-4)
            # (a random model's 49152 logits lie close together: the all-reduce's rounding may move a
            # token a few places among thousands)
            assert abs(lp.rank - w["rank"]) <= 1 + w["rank"] // 200, (lp.rank, w["rank"])
            assert [t for t, _ in lp.top] == [t for t, _ in w["top"]]
