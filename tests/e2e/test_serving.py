"""What a user of a running cluster meets: cancellation, bad input, routing,
overload, and a decode replica that dies or loses its channel (its requests
migrate). Every test ends with all pools free."""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from cluster.client import KVRelayError
from tests.e2e.conftest import disagg_spec, running_cluster

LONG = dict(max_tokens=200, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster(ray_instance):
    with running_cluster(disagg_spec(2, 2, "grpc", router={"policy": "least_loaded"})) as rc:
        yield rc


def _replicas_free(rc):
    assert rc.wait_pools_free() == {rid: True for rid in rc.cluster.actors}


def test_cancel_mid_stream_frees_blocks_on_both_sides(cluster):
    stream = cluster.client.stream("Tell me a long story about a dragon.", **LONG)
    chunks = [next(stream) for _ in range(3)]
    assert any(c.token_ids for c in chunks)
    stream.close()  # cancels the RPC
    _replicas_free(cluster)
    # the cluster still serves
    assert cluster.client.generate("Hello", max_tokens=4, temperature=0).finish_reason is not None


def test_a_one_token_request_gets_its_token_once(cluster):
    """The first token reaches the client from the prefill replica; the decode
    replica's copy, which here also ends the request, adds only the finish."""
    chunks = list(cluster.client.stream("What is the capital of France?", max_tokens=1, temperature=0,
                                        ignore_eos=True, logprobs=1))
    got = [t for c in chunks for t in c.token_ids]
    assert len(got) == 1 and chunks[-1].finish_reason.value == "length"
    assert [lp.token_id for c in chunks for lp in c.logprobs] == got
    assert chunks[-1].usage.completion_tokens == 1
    _replicas_free(cluster)


def test_a_broken_request_channel_migrates_its_requests_then_the_replica_serves_again(cluster):
    """A network fault between the frontend and a live decode replica: the
    request on it migrates to the other pair and its stream goes on token for
    token (greedy: equal to an unfaulted run), its blocks come back on both
    sides, and the replica is placed on again once its channel is redialled."""
    prompt = "Tell me a long story about a dragon."
    want = cluster.client.generate(prompt, **LONG)
    stream = cluster.client.stream(prompt, **LONG)
    got = list(next(stream).token_ids)
    assert got
    deadline = time.monotonic() + 30
    while not (busy := [r.replica_id for r in cluster.client.status().replicas
                        if r.replica_id.startswith("decode") and r.num_running_seqs > 0]):
        assert time.monotonic() < deadline, "no decode replica took the request"
        time.sleep(0.05)
    assert len(busy) == 1, busy

    async def break_channel():
        cluster.cluster.backend.channels.drop(busy[0])
    cluster.run(break_channel())
    chunks = list(stream)
    got += [t for c in chunks for t in c.token_ids]
    assert got == list(want.token_ids) and chunks[-1].finish_reason.value == "length"
    deadline = time.monotonic() + 30
    while not {r.replica_id: r.is_alive for r in cluster.client.status().replicas}[busy[0]]:
        assert time.monotonic() < deadline, "the replica was not placed on again"
        time.sleep(0.1)
    assert cluster.run(_is_connected(cluster, busy[0]))
    _replicas_free(cluster)
    for _ in range(4):  # least_loaded spreads these over both decode replicas again
        assert cluster.client.generate("Hello", max_tokens=4, temperature=0).finish_reason is not None


def _thread_niceness(stage):
    import os

    threads = [stage._thread] + [ch._reader for ch in stage._channels]
    return [os.getpriority(os.PRIO_PROCESS, t.native_id) for t in threads]


def test_models_name_the_local_tokenizer_folder_for_benchmark_clients(cluster, capsys):
    """Benchmark clients (vllm bench serve, guidellm) need the tokenizer and cannot fetch it from a hub."""
    import json
    import urllib.request
    from pathlib import Path

    from cluster.cli import main

    (info,) = cluster.client.list_models()
    assert (Path(info.tokenizer_dir) / "tokenizer.json").is_file()
    assert main(["models", "--target", cluster.target]) == 0
    assert f"tokenizer {info.tokenizer_dir}" in capsys.readouterr().out
    card = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{cluster.http_port}/v1/models", timeout=10).read())
    assert card["data"][0]["root"] == info.tokenizer_dir


def test_replicas_run_their_loop_and_channel_threads_at_normal_priority(cluster):
    """Ray starts workers niced (worker_niceness 15): a replica's loop would
    then give its core to anything that wakes on the host."""
    import ray

    for rid in cluster.cluster.actors:
        nice = ray.get(cluster.actor(rid).__ray_call__.remote(_thread_niceness), timeout=30)
        assert len(nice) == 2 and nice == [0, 0], (rid, nice)


async def _is_connected(cluster, replica_id):
    return cluster.cluster.backend.channels.is_connected(replica_id)


@pytest.mark.parametrize("kwargs, field", [
    (dict(prompt=""), "prompt"),
    (dict(prompt="hi", max_tokens=0), "max_tokens"),
    (dict(prompt="hi", temperature=-1.0), "temperature"),
    (dict(prompt="hi", top_p=1.5), "top_p"),
    (dict(prompt="hi", min_p=2.0), "min_p"),
    (dict(prompt="word " * 9000, max_tokens=4), "prompt"),
    (dict(prompt="hi", model="no-such-model"), "model"),
])
def test_bad_input_is_invalid_argument_and_harms_nothing(cluster, kwargs, field):
    other = ThreadPoolExecutor(1).submit(cluster.client.generate, "Count to five.", max_tokens=16, temperature=0)
    with pytest.raises(KVRelayError) as e:
        cluster.client.generate(**kwargs)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert field in str(e.value)
    assert other.result(timeout=60).finish_reason.value in ("stop", "length")
    _replicas_free(cluster)


def test_least_loaded_sends_new_work_to_the_idle_decode_replica(cluster):
    """Skew the load: decode-0 gets long requests from a second frontend (its
    own request channel to the replica); new requests go to decode-1."""
    import ray

    from engine.sampling import SamplingParams
    from engine.serving.channel import ChannelServer
    from engine.serving.frames import Abort, Submit

    busy = cluster.actor("decode-0")
    tok = cluster.cluster.backend.tokenizer
    ids = tok.encode("Write an essay about the sea.")
    second = ChannelServer(b"another frontend's secret".ljust(32))
    cluster.run(second.start())
    ray.get(busy.connect_channel.remote(second.address, second.secret))
    cluster.run(second.wait_connected(["decode-0"], 10))
    long = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)

    async def skew():
        for i in range(4):
            second.open(f"skew-{i}", ["decode-0"])
            second.send("decode-0", Submit(f"skew-{i}", ids, long))
    cluster.run(skew())
    time.sleep(0.5)  # load reports
    probes = [cluster.client.stream("Say hi.", max_tokens=60, temperature=0, ignore_eos=True) for _ in range(3)]
    for p in probes:
        next(p)
    st = {r.replica_id: r for r in cluster.client.status().replicas}
    assert st["decode-1"].num_in_flight == 3 and st["decode-0"].num_in_flight == 0, st
    for p in probes:
        p.close()

    async def unskew():
        for i in range(4):
            second.send("decode-0", Abort(f"skew-{i}"))
            second.close(f"skew-{i}")
        await second.stop()
    cluster.run(unskew())
    _replicas_free(cluster)


def test_prefix_aware_routes_a_repeated_prefix_to_the_replica_that_cached_it(ray_instance):
    spec = disagg_spec(2, 1, "grpc", router={"policy": "prefix_aware"})
    with running_cluster(spec) as rc:
        system = "You are an expert in medieval history and answer in detail. " * 8
        msgs = lambda q: [{"role": "system", "content": system}, {"role": "user", "content": q}]  # noqa: E731
        first = rc.client.chat(msgs("Who was Charlemagne?"), max_tokens=2, temperature=0)
        assert first.usage.cached_prompt_tokens == 0
        time.sleep(0.3)  # the replica reports its cache
        hits = [rc.client.chat(msgs(q), max_tokens=2, temperature=0).usage.cached_prompt_tokens
                for q in ("What was the Magna Carta?", "Who built castles?", "What is a fief?")]
        # every follow-up reused the cached system prompt: same prefill replica each time
        assert all(h >= 64 for h in hits), hits
        _replicas_free(rc)


def test_overload_queues_then_refuses_and_answers_everyone(ray_instance):
    spec = disagg_spec(1, 1, "grpc", router={"max_queue": 2, "queue_timeout_s": 30,
                                             "max_inflight_per_replica": 2})
    with running_cluster(spec) as rc:
        def one(i):
            try:
                return rc.client.generate(f"Request {i}: tell a story.", max_tokens=40, temperature=0,
                                          ignore_eos=True).finish_reason.value
            except KVRelayError as e:
                return e.code
        with ThreadPoolExecutor(10) as pool:
            results = list(pool.map(one, range(10)))
        ok = [r for r in results if r == "length"]
        refused = [r for r in results if r == grpc.StatusCode.RESOURCE_EXHAUSTED]
        assert len(ok) + len(refused) == 10, results  # every request got an answer
        assert len(ok) >= 4 and refused, results  # 2 running + 2 queued at least; the rest refused
        _replicas_free(rc)


def test_a_killed_decode_replica_loses_no_request_and_is_replaced(ray_instance):
    """SIGKILL-like death of a decode replica mid-stream (Ray kills its
    process): every request on it migrates and finishes with the unfaulted
    greedy tokens, the replica is replaced and serves again, every pool ends free."""
    import ray

    spec = disagg_spec(1, 2, "grpc", router={"policy": "round_robin"})
    with running_cluster(spec) as rc:
        prompts = [f"Story {i}: once upon a time" for i in range(6)]
        params = dict(LONG, max_tokens=120)
        with ThreadPoolExecutor(6) as pool:  # unfaulted, batched as in the faulted run (greedy is batch-invariant)
            want = dict(enumerate(pool.map(lambda p: list(rc.client.generate(p, **params).token_ids), prompts)))
        results = {}

        def one(i):
            try:
                results[i] = list(rc.client.generate(prompts[i], **params).token_ids)
            except KVRelayError as e:
                results[i] = e.code

        threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            st = {r.replica_id: r for r in rc.client.status().replicas}
            if st["decode-0"].num_running_seqs > 0:
                break
            time.sleep(0.1)
        t_kill = time.monotonic()
        ray.kill(rc.actor("decode-0"), no_restart=True)
        for t in threads:
            t.join(120)
        assert time.monotonic() - t_kill < 90
        assert results == want  # none lost, none wrong
        deadline = time.monotonic() + 60
        while not (st := {r.replica_id: r for r in rc.client.status().replicas})["decode-0"].is_alive:
            assert time.monotonic() < deadline, f"decode-0 was not replaced: {st['decode-0']}"
            time.sleep(0.2)
        assert st["decode-0"].num_restarts == 1 and st["decode-1"].is_alive
        for _ in range(3):
            assert rc.client.generate("Hello there", max_tokens=8, temperature=0).finish_reason is not None
        _replicas_free(rc)
