"""Property: whatever an HTTP client sends, the OpenAI frontend answers a clear 4xx or a valid response.

Never a 5xx, never a hang, never a request left running; and a normal
request afterwards still gets the right answer. Bodies are built around the
real schema (known fields with values of any JSON type, unknown fields,
JSON that is not an object, bytes that are not JSON), over the EchoBackend.
"""
import http.client
import json

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.cluster.conftest import EchoBackend
from tests.cluster.test_http import ServedFrontends, wait_for

EXAMPLES = 600  # per body test (a third of it for paths)

SAMPLING_FIELDS = ["model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
                   "stop", "stop_token_ids", "ignore_eos", "n", "stream", "stream_options", "kvrelay_timeline",
                   "presence_penalty", "frequency_penalty", "user", "logprobs", "top_logprobs", "echo", "best_of",
                   "suffix", "repetition_penalty", "logit_bias"]
WORDS = ["hello", "world", "the", "cat", "sat", "on", "a", "mat", "<s>", "</s>", "zebra", ""]

scalars = (st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.integers(-3, 70)
           | st.floats(allow_nan=False, allow_infinity=False) | st.floats(-1, 2) | st.text(max_size=20)
           | st.sampled_from(WORDS))
json_values = st.recursive(scalars, lambda kids: st.lists(kids, max_size=5) | st.dictionaries(
    st.text(max_size=8), kids, max_size=4), max_leaves=8)
prompts = (st.lists(st.sampled_from(WORDS), max_size=8).map(" ".join) | st.lists(st.integers(-2, 20), max_size=70)
           | st.lists(st.sampled_from(WORDS).map(lambda w: w or "hello"), min_size=1, max_size=2) | json_values)
messages = st.lists(st.fixed_dictionaries({}, optional={
    "role": st.sampled_from(["system", "user", "assistant", "", "tool"]) | json_values,
    "content": st.lists(st.sampled_from(WORDS), max_size=6).map(" ".join)
    | st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]), "text": st.text(max_size=10)}),
               max_size=2) | json_values,
}), max_size=4) | json_values


good_prompts = st.lists(st.sampled_from(WORDS[:8]), min_size=1, max_size=8).map(" ".join) | st.lists(
    st.integers(0, 13), min_size=1, max_size=20)
good_messages = st.lists(st.fixed_dictionaries({
    "role": st.sampled_from(["system", "user", "assistant"]),
    "content": st.lists(st.sampled_from(WORDS[:8]), max_size=5).map(" ".join)}), min_size=1, max_size=3)


def bodies(prompt_field: str, prompt_values, good_prompt_values) -> st.SearchStrategy:
    """Mostly-valid bodies (sensible values, some out of range), wild ones (any JSON for any field), non-bodies."""
    sensible = st.fixed_dictionaries({}, optional={
        "max_tokens": st.integers(-1, 70), "temperature": st.floats(-0.5, 3), "top_p": st.floats(-0.2, 1.2),
        "top_k": st.integers(-3, 30), "min_p": st.floats(-0.1, 1.1), "seed": st.integers(-5, 2 ** 64),
        "stop": st.lists(st.sampled_from(WORDS), max_size=3) | st.sampled_from(WORDS),
        "stop_token_ids": st.lists(st.integers(-1, 15), max_size=3),
        "stream": st.booleans(), "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
        "ignore_eos": st.booleans(), "model": st.sampled_from(["echo", "", "echo", "gpt-4"]),
        "logprobs": st.integers(-1, 22) | st.booleans(), "top_logprobs": st.integers(-1, 22),
        "kvrelay_timeline": st.booleans(), "n": st.integers(0, 2), "user": json_values,
    })
    mostly_valid = st.builds(lambda b, p: {**b, prompt_field: p}, sensible, good_prompt_values)
    known = st.fixed_dictionaries({}, optional={name: json_values for name in SAMPLING_FIELDS})
    extra = st.dictionaries(st.text(max_size=12), json_values, max_size=3)
    wild = st.builds(lambda a, b, c, p: {**c, **a, **b, **p}, known, sensible, extra,
                     st.fixed_dictionaries({}, optional={prompt_field: prompt_values}))
    as_json = lambda b: json.dumps(b).encode()  # noqa: E731
    return (mostly_valid.map(as_json) | wild.map(as_json) | json_values.map(as_json)
            | st.binary(max_size=64))


@pytest.fixture(scope="module")
def server():
    served = ServedFrontends(EchoBackend())
    served.conn = http.client.HTTPConnection("127.0.0.1", served.frontends.http_port, timeout=10)
    yield served
    served.conn.close()
    served.close()


def post(server, path: str, body: bytes) -> tuple[int, dict[str, str], bytes]:
    try:
        server.conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        response = server.conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    except (http.client.HTTPException, ConnectionError):
        server.conn.close()  # the server closed a keep-alive connection: a fresh one
        server.conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        response = server.conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()


def check_answer(status: int, headers: dict[str, str], raw: bytes, chat: bool) -> None:
    event(f"HTTP {status}")
    assert status < 500, raw[:300]
    if status != 200:
        error = json.loads(raw)["error"]
        assert 400 <= status < 500 and isinstance(error["message"], str) and len(error["message"]) <= 1024
        return
    if headers.get("Content-Type", "").startswith("text/event-stream"):
        events = [line[len("data: "):] for line in raw.decode().split("\n\n") if line]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert all("error" not in c for c in chunks)
        finishes: dict[int, list] = {}  # per choice index
        for c in chunks:
            for choice in c.get("choices") or ():
                finishes.setdefault(choice["index"], []).append(choice["finish_reason"])
        assert finishes and sorted(finishes) == list(range(len(finishes)))
        for f in finishes.values():
            assert f[-1] in ("stop", "length") and all(x is None for x in f[:-1])
        return
    body = json.loads(raw)
    assert [c["index"] for c in body["choices"]] == list(range(len(body["choices"])))
    for choice in body["choices"]:
        assert choice["finish_reason"] in ("stop", "length")
        assert isinstance(choice["message"]["content"] if chat else choice["text"], str)
    assert body["usage"]["completion_tokens"] >= len(body["choices"])


def after(server) -> None:
    wait_for(lambda: not server.backend.running)
    status, _, raw = post(server, "/v1/completions", b'{"prompt": "hello world"}')
    assert status == 200 and json.loads(raw)["choices"][0]["text"] == "<s> hello world "


FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))


@FUZZ
@given(body=bodies("prompt", prompts, good_prompts))
def test_completions_answer_every_body_with_a_4xx_or_a_completion(server, body):
    status, headers, raw = post(server, "/v1/completions", body)
    check_answer(status, headers, raw, chat=False)


@FUZZ
@given(body=bodies("messages", messages, good_messages))
def test_chat_completions_answer_every_body_with_a_4xx_or_a_completion(server, body):
    status, headers, raw = post(server, "/v1/chat/completions", body)
    check_answer(status, headers, raw, chat=True)


@settings(max_examples=EXAMPLES // 3, deadline=None, suppress_health_check=list(HealthCheck))
@given(method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH"]),
       path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/"])
       | st.text(st.characters(min_codepoint=33, max_codepoint=126), max_size=30).map(lambda p: "/" + p),
       body=st.binary(max_size=32))
def test_any_method_and_path_gets_an_answer_below_500(server, method, path, body):
    try:
        server.conn.request(method, path, body=body)
        response = server.conn.getresponse()
    except (http.client.HTTPException, ConnectionError):
        server.conn.close()
        return  # a request line http.client or aiohttp refuses outright; the next check proves the server lives
    response.read()
    assert response.status < 500


def test_the_server_still_answers_right_after_the_fuzzing(server):
    after(server)
