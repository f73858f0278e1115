"""n > 1 on a disaggregated cluster (real local Ray, gRPC transfer, the real
default model) through the official `openai` client, with one transfer: the
prefill replica computes the prompt once and sends its blocks once (as its
/metrics counters show), and the n choices fork on the decode replica.
Greedy choices equal engine.LLM's; seeded ones equal a colocated cluster's
for the same seeds; a decode replica killed mid-way ends every choice;
every pool is free after."""
from __future__ import annotations

import threading
import time
import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.llm import LLM
from engine.sampling import SamplingParams
from tests.e2e.conftest import colocated_spec, disagg_spec, running_cluster

BLOCK = 16
N = 3


def _client(rc) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{rc.http_port}/v1", api_key="unused", max_retries=0,
                         timeout=120)


@pytest.fixture(scope="module")
def reference(default_model_dir):
    return LLM(str(default_model_dir), dtype="float32", num_kv_blocks=128)


@pytest.fixture(scope="module")
def prompt(reference) -> list[int]:
    """2 full blocks, which the choices share, and 5 tokens each computes itself."""
    ids = reference.tokenizer.encode("The lighthouse keeper wrote in his log every night, and tonight he wrote "
                                     "about the storm that came in from the west over the grey water, the "
                                     "ships that sheltered in the bay, and the lamp that he kept burning")
    assert len(ids) >= 2 * BLOCK + 5
    return ids[: 2 * BLOCK + 5]


@pytest.fixture(scope="module")
def cluster(ray_instance):
    # no prefix cache on the prefill replica: each request's prompt is computed there, once
    spec = disagg_spec(1, 2, "grpc", router={"policy": "round_robin"})
    spec["prefill"]["enable_prefix_caching"] = False
    with running_cluster(spec) as rc:
        yield rc


def _counters(rc) -> dict[tuple[str, str], float]:
    """(series, replica) -> value of the replicas' counters in /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{rc.http_port}/metrics", timeout=30) as r:
        text = r.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in ("kvrelay_replica_prompt_tokens_computed_total", "kvrelay_replica_kv_sent_bytes_total"):
                out[s.name.removeprefix("kvrelay_replica_").removesuffix("_total"), s.labels["replica"]] = s.value
    return out


def _settled(rc) -> dict[tuple[str, str], float]:
    """The counters once every request ended and the replicas reported it (their load comes every 50 ms)."""
    assert rc.wait_pools_free() == {rid: True for rid in rc.cluster.actors}
    time.sleep(0.5)
    return _counters(rc)


def _moved(before: dict, after: dict, name: str, stage: str) -> float:
    return sum(v - before.get(k, 0.0) for k, v in after.items() if k[0] == name and k[1].startswith(stage))


def test_greedy_choices_equal_the_engines_from_one_prefill_and_one_transfer(cluster, reference, prompt):
    client = _client(cluster)
    model = client.models.list().data[0].id
    want = reference.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, n=N))
    base = _settled(cluster)
    one = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True})
    mid = _settled(cluster)
    many = client.completions.create(model=model, prompt=prompt, n=N, max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True})
    after = _settled(cluster)
    assert [c.text for c in many.choices] == [o.text for o in want] == [one.choices[0].text] * N
    # the prefill replica computed the prompt once and sent its blocks once, as for n=1
    assert _moved(mid, after, "prompt_tokens_computed", "prefill") == len(prompt)
    assert _moved(base, mid, "prompt_tokens_computed", "prefill") == len(prompt)
    sent_one = _moved(base, mid, "kv_sent_bytes", "prefill")
    assert sent_one > 0 and _moved(mid, after, "kv_sent_bytes", "prefill") == sent_one
    # the forks computed only their own tail on the decode replica
    assert _moved(mid, after, "prompt_tokens_computed", "decode") == (N - 1) * 5
    assert many.usage.prompt_tokens_details.cached_tokens == 2 * BLOCK  # the shared blocks


def test_seeded_choices_equal_a_colocated_clusters(cluster, ray_instance, prompt):
    kwargs = dict(prompt=prompt, n=N, max_tokens=12, temperature=1.0, seed=5, extra_body={"ignore_eos": True})
    client = _client(cluster)
    model = client.models.list().data[0].id
    disagg = [[c.text for c in client.completions.create(model=model, **kwargs).choices] for _ in range(2)]
    assert disagg[0] == disagg[1] and len(set(disagg[0])) == N
    with running_cluster(colocated_spec(1)) as colocated:
        c = _client(colocated)
        assert [ch.text for ch in c.completions.create(model=model, **kwargs).choices] == disagg[0]
        assert colocated.wait_pools_free() == {rid: True for rid in colocated.cluster.actors}
    assert cluster.wait_pools_free() == {rid: True for rid in cluster.cluster.actors}


def test_a_decode_replica_killed_mid_way_ends_every_choice(cluster, prompt):
    import ray

    client = _client(cluster)
    model = client.models.list().data[0].id
    result: dict = {}

    def run():
        try:
            result["response"] = client.completions.create(model=model, prompt=prompt, n=N, max_tokens=200,
                                                           temperature=0, extra_body={"ignore_eos": True})
        except openai.APIError as e:
            result["error"] = e

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 60
    victim = None
    while victim is None and time.monotonic() < deadline:
        running = {r.replica_id: r.num_running_seqs for r in cluster.client.status().replicas}
        victim = next((rid for rid, n in running.items() if rid.startswith("decode") and n >= N), None)
        time.sleep(0.05)
    assert victim is not None, "the choices never ran together on a decode replica"
    ray.kill(cluster.actor(victim), no_restart=True)
    thread.join(180)
    assert not thread.is_alive(), "a choice never ended"
    if "response" in result:  # migrated: each choice re-prefilled alone, the same greedy tokens
        texts = [c.text for c in result["response"].choices]
        assert len(texts) == N and len(set(texts)) == 1 and all(c.finish_reason == "length"
                                                                 for c in result["response"].choices)
    else:  # or a clear error
        assert "request lost" in str(result["error"]) or result["error"].status_code == 503, result["error"]
    deadline = time.monotonic() + 90
    while not {r.replica_id: r for r in cluster.client.status().replicas}[victim].is_alive:
        assert time.monotonic() < deadline, f"{victim} was not replaced"
        time.sleep(0.2)
    assert cluster.wait_pools_free() == {rid: True for rid in cluster.cluster.actors}
