"""Property: whatever a gRPC client sends to Generate, it gets INVALID_ARGUMENT or a valid stream.

Never UNKNOWN or INTERNAL (a crash), never RESOURCE_EXHAUSTED from an error
too big for its trailer, never a hang, never a request left running; and a
normal request afterwards still gets the right answer. Requests are built
from the schema with values across each field's whole range, and some are
then cut or corrupted byte by byte.
"""
import grpc
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from cluster.client import KVRelayClient
from protos.kvrelay.v1 import serving_pb2 as pb
from tests.cluster.conftest import WORDS, EchoBackend, ServedFrontend
from tests.cluster.test_http import wait_for

EXAMPLES = 1000

INT32 = st.integers(-2 ** 31, 2 ** 31 - 1)
words = st.lists(st.sampled_from(WORDS + ["zebra", ""]), max_size=8).map(" ".join)
texts = words | st.text(max_size=40)
floats = st.floats(width=32) | st.floats(-1, 2, width=32)


def optional(strategy):
    return st.none() | strategy


SENSIBLE = {"max_tokens": st.integers(0, 40), "temperature": st.floats(0, 2, width=32),
            "top_p": st.floats(0.0625, 1, width=32), "top_k": st.integers(-1, 20), "min_p": st.floats(0, 1, width=32),
            "seed": st.integers(0, 2 ** 40), "logprobs": st.integers(0, 20)}
WILD = {"max_tokens": st.integers(-2, 70) | INT32, "temperature": floats, "top_p": floats,
        "top_k": st.integers(-3, 20) | INT32, "min_p": floats, "seed": st.integers(-2 ** 63, 2 ** 63 - 1),
        "logprobs": st.integers(-2, 22) | INT32}
good_words = st.lists(st.sampled_from(WORDS[6:]), min_size=1, max_size=6).map(" ".join)


@st.composite
def sampling(draw, sensible: bool) -> pb.SamplingParams:
    if sensible:
        s = pb.SamplingParams(stop=draw(st.lists(st.sampled_from(WORDS[6:]), max_size=2)),
                              stop_token_ids=draw(st.lists(st.integers(0, 13), max_size=2)),
                              ignore_eos=draw(st.booleans()))
    else:
        s = pb.SamplingParams(stop=draw(st.lists(texts, max_size=18)),
                              stop_token_ids=draw(st.lists(st.integers(-2, 20) | INT32, max_size=4)),
                              ignore_eos=draw(st.booleans()))
    for name, values in (SENSIBLE if sensible else WILD).items():
        value = draw(optional(values))
        if value is not None:
            setattr(s, name, value)
    return s


@st.composite
def requests(draw) -> pb.GenerateRequest:
    if draw(st.booleans()):  # mostly valid: these reach the backend
        req = pb.GenerateRequest(model=draw(st.sampled_from(["", "echo"])), timeline=draw(st.booleans()))
        kind = draw(st.sampled_from(["text", "chat", "token_ids"]))
        if kind == "text":
            req.text = draw(good_words)
        elif kind == "chat":
            req.chat.messages.add(role="user", content=draw(good_words))
        else:
            req.token_ids.ids.extend(draw(st.lists(st.integers(0, 13), min_size=1, max_size=30)))
        if draw(st.booleans()):
            req.sampling.CopyFrom(draw(sampling(sensible=True)))
        return req
    req = pb.GenerateRequest(model=draw(st.sampled_from(["", "echo", "gpt-4"]) | st.text(max_size=20)
                                        | st.just("m" * 10_000)),
                             request_id=draw(st.sampled_from([""]) | st.text(max_size=10) | st.just("r" * 200)),
                             timeline=draw(st.booleans()))
    kind = draw(st.sampled_from(["text", "chat", "token_ids", "none"]))
    if kind == "text":
        req.text = draw(texts)
    elif kind == "chat":
        req.chat.SetInParent()
        for _ in range(draw(st.integers(0, 3))):
            req.chat.messages.add(role=draw(st.sampled_from(["user", "system", "assistant", ""]) | texts),
                                  content=draw(texts))
    elif kind == "token_ids":
        req.token_ids.SetInParent()
        req.token_ids.ids.extend(draw(st.lists(st.integers(-1, 14) | INT32, max_size=70)))
    if draw(st.booleans()):
        req.sampling.CopyFrom(draw(sampling(sensible=False)))
    return req


@st.composite
def payloads(draw) -> bytes:
    raw = draw(requests()).SerializeToString()
    how = draw(st.sampled_from(["as is", "as is", "cut", "flip", "insert", "junk"]))
    if how == "cut" and raw:
        raw = raw[:draw(st.integers(0, len(raw) - 1))]
    elif how == "flip" and raw:
        i = draw(st.integers(0, len(raw) - 1))
        raw = raw[:i] + bytes([raw[i] ^ draw(st.integers(1, 255))]) + raw[i + 1:]
    elif how == "insert":
        i = draw(st.integers(0, len(raw)))
        raw = raw[:i] + draw(st.binary(min_size=1, max_size=8)) + raw[i:]
    elif how == "junk":
        raw = draw(st.binary(max_size=64))
    return raw


@pytest.fixture(scope="module")
def server():
    served = ServedFrontend(EchoBackend())
    channel = grpc.insecure_channel(served.target)
    served.generate = channel.unary_stream("/kvrelay.v1.KVRelay/Generate", request_serializer=None,
                                           response_deserializer=pb.GenerateResponse.FromString)
    yield served
    channel.close()
    served.close()


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(raw=payloads())
def test_generate_answers_every_payload_with_invalid_argument_or_a_stream(server, raw):
    try:
        replies = list(server.generate(raw, timeout=10))
    except grpc.RpcError as e:
        event(e.code().name)
        assert e.code() is grpc.StatusCode.INVALID_ARGUMENT, (e.code(), e.details())
        assert len(e.details()) <= 1024
        return
    event("OK")
    assert replies, "a stream with no message"
    assert replies[-1].finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)
    assert all(r.finish_reason == pb.FINISH_REASON_UNSPECIFIED for r in replies[:-1])
    assert replies[-1].usage.completion_tokens == sum(len(r.token_ids) for r in replies) >= 1


def test_the_server_still_answers_right_after_the_fuzzing(server):
    wait_for(lambda: not server.backend.running)
    with KVRelayClient(server.target, timeout=10) as client:
        assert client.generate("hello world").token_ids == [1, 6, 7]
