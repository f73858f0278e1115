"""Every failure maps to the same code on both frontends (`cluster.errors`), with a short message.

Both frontends run over the EchoBackend from `serve_frontends`; each case
ends with the backend holding no request and a normal request answered.
"""
import json
import logging

import grpc
import openai
import pytest

from cluster import grpc_frontend
from cluster.client import KVRelayClient, KVRelayError
from cluster.errors import MAX_MESSAGE_CHARS, clip, quote
from cluster.types import InvalidRequestError, NoReplicaError, OverloadedError
from protos.kvrelay.v1 import serving_pb2 as pb
from tests.cluster.conftest import EchoBackend
from tests.cluster.test_http import ServedFrontends, wait_for

HELLO = [1, 6, 7]  # "<s> hello world"


@pytest.fixture(scope="module")
def both():
    server = ServedFrontends(EchoBackend())
    yield server
    server.close()


@pytest.fixture
def served(both):
    both.backend.reset()
    yield both
    both.backend.reset()
    with KVRelayClient(both.grpc_target, timeout=10) as client:  # a normal request still gets its answer
        assert client.generate("hello world").token_ids == HELLO
    status, body = both.post("/v1/completions", json.dumps({"prompt": "hello world"}).encode())
    assert status == 200 and body["choices"][0]["text"] == "<s> hello world "
    wait_for(lambda: not both.backend.running)


def grpc_failure(served, **kwargs) -> KVRelayError:
    with KVRelayClient(served.grpc_target, timeout=10) as client, pytest.raises(KVRelayError) as info:
        list(client.stream(kwargs.pop("prompt", "hello world"), **kwargs))
    return info.value


def http_failure(served, **body) -> tuple[int, dict]:
    return served.post("/v1/completions", json.dumps({"prompt": "hello world", **body}).encode())


FAILURES = [  # what the backend does, the gRPC code, the HTTP status, words the message holds
    (dict(raise_first=NoReplicaError("no live decode replica")), grpc.StatusCode.UNAVAILABLE, 503,
     "no live decode replica"),
    (dict(overloaded=True), grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "busy"),
    (dict(raise_first=InvalidRequestError("prompt", "too long for the decode pool")),
     grpc.StatusCode.INVALID_ARGUMENT, 400, "prompt: too long"),
    (dict(raise_first=TimeoutError("no placement within 30s")), grpc.StatusCode.DEADLINE_EXCEEDED, 504,
     "no placement within 30s"),
    (dict(raise_first=RuntimeError("channel to d0 broke")), grpc.StatusCode.UNAVAILABLE, 503,
     "channel to d0 broke"),
    (dict(error_after=0), grpc.StatusCode.UNAVAILABLE, 503, "died mid-stream"),  # FinishReason.ERROR first
    (dict(error_after=1), grpc.StatusCode.UNAVAILABLE, 503, "died mid-stream"),  # ... after a token
    (dict(fail_after=1), grpc.StatusCode.UNAVAILABLE, 503, "replica d0 died"),
]


@pytest.mark.parametrize("backend, code, status, words", FAILURES)
def test_a_failure_maps_the_same_on_both_frontends(served, backend, code, status, words):
    for name, value in backend.items():
        setattr(served.backend, name, value)
    err = grpc_failure(served)
    assert err.code is code and words in err.message
    got, body = http_failure(served)
    assert got == status and words in body["error"]["message"]
    assert got != 500


def test_a_failure_mid_stream_is_an_error_event_on_http_and_unavailable_on_grpc(served):
    served.backend.error_after = 1
    assert grpc_failure(served).code is grpc.StatusCode.UNAVAILABLE
    stream = served.client().completions.create(model="echo", prompt="hello world", stream=True)
    texts = []
    with pytest.raises(openai.APIError, match="died mid-stream"):
        for chunk in stream:
            texts.append(chunk.choices[0].text)
    assert texts == ["<s> "]


def test_refusals_carry_retry_after_on_http(served):
    for name, value in (("overloaded", True), ("no_replica", True)):
        served.backend.reset()
        setattr(served.backend, name, value)
        with pytest.raises(openai.APIStatusError) as info:
            served.client().completions.create(model="echo", prompt="hello")
        assert info.value.response.headers["Retry-After"] == "1"


def test_a_bug_in_the_frontend_is_the_only_500(served, monkeypatch):
    from cluster import openai_protocol

    def broken(*args, **kwargs):
        raise KeyError("a bug")

    monkeypatch.setattr(openai_protocol, "to_generate_request", broken)
    status, body = served.post("/v1/completions", json.dumps({"prompt": "hello"}).encode())
    assert status == 500 and body["error"]["type"] == "server_error"
    monkeypatch.undo()


def test_a_huge_model_name_is_invalid_argument_with_a_short_message(served):
    name = "m" * 10_000
    err = grpc_failure(served, model=name)
    assert err.code is grpc.StatusCode.INVALID_ARGUMENT  # not RESOURCE_EXHAUSTED from a trailer past 8 KB
    assert err.message.startswith("model: unknown model 'mmm") and len(err.message) < 300
    with pytest.raises(openai.NotFoundError) as info:
        served.client().completions.create(model=name, prompt="hello")
    assert len(info.value.message) < 300
    status, body = served.get("/v1/models/" + name[:5000])  # a whole 10,000 is past aiohttp's line limit (400)
    assert status == 404 and len(body) < 600


@pytest.mark.parametrize("body, field", [
    ('{"prompt": "hello", "max_tokens": 1%s}' % ("0" * 5000), "body"),  # the JSON parser refuses it
    ('{"prompt": "hello", "suffix": "%s"}' % ("s" * 100_000), "suffix"),
    ('{"prompt": "hello", "stop_token_ids": [-1%s]}' % ("0" * 600), "stop_token_ids"),
    ('{"prompt": [1%s, 1]}' % ("0" * 60), "prompt"),
    ('{"prompt": "hello", "%s": 1, "temperature": "%s"}' % ("k" * 50_000, "t" * 50_000), "temperature"),
])
def test_errors_that_quote_input_stay_short(served, body, field):
    status, reply = served.post("/v1/completions", body.encode())
    assert status == 400 and reply["error"]["param"] == field
    assert len(reply["error"]["message"]) <= MAX_MESSAGE_CHARS


def test_undecodable_generate_bytes_are_invalid_argument_logged_once(served, caplog):
    grpc_frontend._log_junk._next_at = 0.0  # a fresh rate window
    junk = [b"\xff" * 7, b"\x0a\xff\xff\xff\xff\x0f", b"\x12\x05abc", b"\x80", bytes(range(256))]
    with grpc.insecure_channel(served.grpc_target) as channel:
        call = channel.unary_stream("/kvrelay.v1.KVRelay/Generate", request_serializer=None,
                                    response_deserializer=pb.GenerateResponse.FromString)
        with caplog.at_level(logging.DEBUG, logger="cluster.grpc_frontend"):
            for raw in junk * 20:
                with pytest.raises(grpc.RpcError) as info:
                    list(call(raw, timeout=10))
                assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
                assert "not a valid GenerateRequest" in info.value.details()
    lines = [r for r in caplog.records if "not a GenerateRequest" in r.getMessage()]  # one line for 100 calls
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING and not lines[0].exc_info
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not served.backend.requests


@pytest.mark.parametrize("method", ["GetStatus", "ListModels", "Profile"])
def test_undecodable_bytes_on_any_rpc_are_invalid_argument(served, method):
    with grpc.insecure_channel(served.grpc_target) as channel:
        call = channel.unary_unary(f"/kvrelay.v1.KVRelay/{method}", request_serializer=None,
                                   response_deserializer=None)
        with pytest.raises(grpc.RpcError) as info:
            call(b"\xff\xff", timeout=10)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "not a valid" in info.value.details()


def test_status_leaves_a_dead_replicas_load_unset(served):
    with KVRelayClient(served.grpc_target) as client:
        c0, c1 = client.status().replicas
    assert c0.is_alive and c0.num_total_blocks == 100
    assert not c1.is_alive  # EchoBackend's c1 is dead with a stale report of 7 running, 300 queued
    assert (c1.num_running_seqs, c1.num_queued_prefill_tokens, c1.num_in_flight, c1.num_total_blocks) == (0, 0, 0, 0)


def test_clip_and_quote():
    assert clip("short") == "short"
    long = clip("x" * 5000)
    assert len(long) == MAX_MESSAGE_CHARS and long.endswith("more characters)")
    assert quote("abc") == "'abc'"
    assert len(quote("y" * 10_000)) < 100
    assert "too long" in quote(10 ** 5000)
