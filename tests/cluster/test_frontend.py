import asyncio
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from cluster.client import AsyncKVRelayClient, KVRelayClient, KVRelayError
from cluster.types import FinishReason
from tests.cluster.conftest import EchoBackend, ServedFrontend

HELLO = [1, 6, 7]  # "<s> hello world"


def wait_for(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.01)


def test_generate_streams_tokens_and_usage(served):
    with KVRelayClient(served.target) as client:
        chunks = list(client.stream("hello world the cat", max_tokens=3, temperature=0))
        result = client.generate("hello world", max_tokens=10)
    assert [c.token_ids for c in chunks] == [[1], [6], [7]]
    assert "".join(c.text for c in chunks) == "<s> hello world "
    assert [c.finish_reason for c in chunks] == [None, None, FinishReason.LENGTH]
    assert chunks[-1].usage.prompt_tokens == 5 and chunks[-1].usage.completion_tokens == 3
    assert chunks[-1].usage.cached_prompt_tokens == 2
    assert all(c.usage is None for c in chunks[:-1])
    assert result.token_ids == HELLO and result.finish_reason is FinishReason.STOP
    assert result.text == "<s> hello world " and result.request_id


def test_timeline_only_when_asked(served):
    with KVRelayClient(served.target) as client:
        plain = client.generate("hello world", max_tokens=2)
        chunks = list(client.stream("hello world", max_tokens=2, timeline=True))
    assert plain.timeline is None and not served.backend.requests[0].timeline
    assert served.backend.requests[1].timeline
    assert all(c.timeline is None for c in chunks[:-1])
    t = chunks[-1].timeline
    assert t.phases() == {"routed_s": pytest.approx(0.001), "prefill_end_s": pytest.approx(0.01),
                          "finish_s": pytest.approx(0.02)}


def test_profile_rpc(served, tmp_path):
    with KVRelayClient(served.target) as client:
        traces = client.profile(0.25, str(tmp_path))
        assert [(t.replica_id, t.host, t.path) for t in traces] == [("c0", "host-a", f"{tmp_path}/c0-1.json")]
        for seconds, out, field in ((0, "d", "seconds"), (601, "d", "seconds"), (1, "", "out_dir")):
            with pytest.raises(KVRelayError) as e:
                client.profile(seconds, out)
            assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and field in e.value.message
    assert served.backend.profiles == [(0.25, str(tmp_path))]


def test_sampling_params_reach_the_backend(served):
    with KVRelayClient(served.target) as client:
        client.generate(token_ids=[6, 7], max_tokens=2, temperature=0.5, top_p=0.9, top_k=0, min_p=0.1, seed=7,
                        stop=["cat"], stop_token_ids=[2], ignore_eos=True, request_id="mine-1")
        client.generate("hello")
    req, default = served.backend.requests
    s = req.sampling
    assert req.request_id == "mine-1" and req.prompt_token_ids == [6, 7]
    assert (s.max_tokens, s.top_k, s.seed, s.stop, s.stop_token_ids, s.ignore_eos) == (2, -1, 7, ("cat",), (2,), True)
    assert s.temperature == pytest.approx(0.5) and s.top_p == pytest.approx(0.9) and s.min_p == pytest.approx(0.1)
    d = default.sampling
    assert (d.temperature, d.top_p, d.top_k, d.min_p, d.seed, d.logprobs) == (1.0, 1.0, -1, 0.0, None, None)
    assert (d.presence_penalty, d.frequency_penalty, d.repetition_penalty, d.logit_bias) == (0.0, 0.0, 1.0, ())
    assert d.max_tokens == EchoBackend.max_model_len - 2  # the rest of the context


def test_penalties_and_logit_bias_reach_the_backend(served):
    with KVRelayClient(served.target) as client:
        client.generate("hello", presence_penalty=0.5, frequency_penalty=-1.0, repetition_penalty=1.25,
                        logit_bias={7: -100.0, 6: 2.5})
    s = served.backend.requests[0].sampling
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0.5, -1.0, 1.25)
    assert s.logit_bias == ((6, 2.5), (7, -100.0))


def test_chat_uses_the_template(served):
    with KVRelayClient(served.target) as client:
        result = client.chat([{"role": "system", "content": "a cat"}, {"role": "user", "content": "hello"}],
                             max_tokens=20)
    # "<s> <|system|> a cat <|user|> hello <|assistant|>", BOS once.
    assert served.backend.requests[0].prompt_token_ids == [1, 3, 12, 9, 4, 6, 5]
    assert result.token_ids == [1, 3, 12, 9, 4, 6, 5]


def test_logprobs(served):
    with KVRelayClient(served.target) as client:
        result = client.generate("hello", max_tokens=2, logprobs=2)
    assert len(result.logprobs) == 2
    assert result.logprobs[1].token_id == 6 and result.logprobs[1].logprob == pytest.approx(-0.5)
    assert [t for t, _ in result.logprobs[0].top] == [0, 1]


@pytest.mark.parametrize("kwargs, message", [
    (dict(prompt="hello", max_tokens=0), "max_tokens: must be >= 1, got 0"),
    (dict(prompt="hello", max_tokens=100), "max_tokens: 100 plus the prompt's 2 tokens exceed"),
    (dict(prompt="hello", temperature=-0.1), "temperature: must be >= 0"),
    (dict(prompt="hello", top_p=0.0), "top_p: must be in (0, 1]"),
    (dict(prompt="hello", top_p=1.5), "top_p: must be in (0, 1]"),
    (dict(prompt="hello", top_k=-2), "top_k: must be >= 1, or 0 or -1 to disable"),
    (dict(prompt="hello", min_p=1.5), "min_p: must be in [0, 1]"),
    (dict(prompt="hello", logprobs=21), "logprobs: must be in [0, 20]"),
    (dict(prompt="hello", stop=[""]), "stop: strings must not be empty"),
    (dict(prompt="hello", stop_token_ids=[999]), "stop_token_ids: token id 999 is outside the vocabulary"),
    (dict(prompt="hello", model="gpt-4"), "model: unknown model 'gpt-4'"),
    (dict(prompt=""), "prompt: must not be empty"),
    (dict(token_ids=[]), "prompt: must not be empty"),
    (dict(token_ids=[6] * 64), "prompt: 64 tokens leave no room"),
    (dict(token_ids=[6, 14]), "prompt: token id 14 is outside the vocabulary"),
    (dict(messages=[]), "chat: must hold at least one message"),
    (dict(prompt="hello", presence_penalty=2.5), "presence_penalty: must be in [-2, 2]"),
    (dict(prompt="hello", frequency_penalty=-3.0), "frequency_penalty: must be in [-2, 2]"),
    (dict(prompt="hello", repetition_penalty=0.0), "repetition_penalty: must be > 0"),
    (dict(prompt="hello", logit_bias={99: 1.0}), "logit_bias: token id 99 is outside the vocabulary"),
    (dict(prompt="hello", logit_bias={6: 101.0}), "logit_bias: bias of token 6 must be in [-100, 100]"),
])
def test_invalid_requests_name_the_field(served, kwargs, message):
    with KVRelayClient(served.target) as client:
        with pytest.raises(KVRelayError) as info:
            client.generate(**kwargs)
    assert info.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.message.startswith(message)
    assert not served.backend.requests


def test_client_cancellation_aborts_the_request(served):
    served.backend.delay_s = 0.05
    with KVRelayClient(served.target) as client:
        stream = client.stream("hello", max_tokens=50, ignore_eos=True, request_id="to-cancel")
        first = next(stream)
        assert first.token_ids == [1]
        stream.close()  # cancels the call
    wait_for(lambda: "to-cancel" in served.backend.aborted)
    wait_for(lambda: not served.backend.running)


def test_overload_is_resource_exhausted(served):
    served.backend.overloaded = True
    with KVRelayClient(served.target) as client, pytest.raises(KVRelayError) as info:
        client.generate("hello")
    assert info.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "busy" in info.value.message


def test_backend_failure_is_unavailable_and_aborts(served):
    served.backend.fail_after = 1
    with KVRelayClient(served.target) as client:
        got = []
        with pytest.raises(KVRelayError) as info:
            for chunk in client.stream("hello world", request_id="doomed"):
                got.append(chunk)
    assert info.value.code is grpc.StatusCode.UNAVAILABLE
    assert "replica d0 died" in info.value.message
    assert [c.token_ids for c in got] == [[1]]
    wait_for(lambda: "doomed" in served.backend.aborted)


def test_list_models_and_status(served):
    with KVRelayClient(served.target) as client:
        (model,) = client.list_models()
        status = client.status()
    assert (model.id, model.max_model_len, model.vocab_size) == ("echo", 64, 14)
    assert status.model_name == "echo" and status.mode == "colocated"
    assert [(r.replica_id, r.is_alive) for r in status.replicas] == [("c0", True), ("c1", False)]
    assert status.replicas[0].kv_usage == pytest.approx(0.25)


def test_health_and_reflection(served):
    with grpc.insecure_channel(served.target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "kvrelay.v1.KVRelay"):
            assert health.Check(health_pb2.HealthCheckRequest(service=service)).status == \
                health_pb2.HealthCheckResponse.SERVING
        services = ProtoReflectionDescriptorDatabase(channel).get_services()
    assert {"kvrelay.v1.KVRelay", "grpc.health.v1.Health"} <= set(services)


def test_async_client_runs_requests_concurrently(served):
    served.backend.delay_s = 0.01

    async def main():
        async with AsyncKVRelayClient(served.target) as client:
            results = await asyncio.gather(*(client.generate("hello world the", max_tokens=4) for _ in range(8)))
            chunks = [c async for c in client.stream(token_ids=[6, 7], max_tokens=5)]
            with pytest.raises(KVRelayError) as info:
                await client.generate("hello", top_p=2.0)
            models = await client.list_models()
        return results, chunks, info.value, models

    results, chunks, err, models = asyncio.run(main())
    assert all(r.token_ids == [1, 6, 7, 8] and r.finish_reason is FinishReason.LENGTH for r in results)
    assert len({r.request_id for r in results}) == 8
    assert [c.token_ids for c in chunks] == [[6], [7]] and chunks[-1].finish_reason is FinishReason.STOP
    assert err.code is grpc.StatusCode.INVALID_ARGUMENT and models[0].id == "echo"


def test_api_keys():
    server = ServedFrontend(EchoBackend(), api_keys=("k-alpha", "k-beta"))
    try:
        for key in (None, "wrong"):
            with KVRelayClient(server.target, api_key=key) as client:
                for call in (lambda: client.generate("hello"), client.list_models, client.status):
                    with pytest.raises(KVRelayError) as info:
                        call()
                    assert info.value.code is grpc.StatusCode.UNAUTHENTICATED
        with KVRelayClient(server.target, api_key="k-beta") as client:
            assert client.generate("hello").token_ids == [1, 6]
        with grpc.insecure_channel(server.target) as channel:  # health needs no key
            assert health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest()).status == \
                health_pb2.HealthCheckResponse.SERVING
        assert len(server.backend.requests) == 1  # refused calls never reach the backend
    finally:
        server.close()


def test_tls(tls_cert):
    cert, key = tls_cert
    server = ServedFrontend(EchoBackend(), tls_cert_file=str(cert), tls_key_file=str(key))
    try:
        with KVRelayClient(server.target, root_certificates=cert) as client:
            assert client.generate("hello world").token_ids == HELLO
        with KVRelayClient(server.target, timeout=2) as plaintext, pytest.raises(KVRelayError):
            plaintext.generate("hello")
    finally:
        server.close()
