"""The OpenAI HTTP frontend through the official `openai` client, and the shared metrics.

Both frontends run over the EchoBackend (tests/cluster/conftest.py) from
`serve_frontends`, on 127.0.0.1 with free ports, in a background event loop.
"""
import asyncio
import contextlib
import faulthandler
import json
import ssl
import sys
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster.client import KVRelayClient, KVRelayError
from cluster.frontends import serve_frontends
from cluster.configs import FrontendConfig
from tests.cluster.conftest import EchoBackend

CHAT = [{"role": "system", "content": "a cat"}, {"role": "user", "content": "hello"}]
CHAT_IDS = [1, 3, 12, 9, 4, 6, 5]  # "<s> <|system|> a cat <|user|> hello <|assistant|>"


def wait_for(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.01)


class ServedFrontends:
    """gRPC + HTTP frontends from serve_frontends, in a background event loop."""

    def __init__(self, backend, **config):
        self.backend = backend
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        config = FrontendConfig(host="127.0.0.1", grpc_port=0, http_port=0, **config)
        self.frontends = self.call(serve_frontends(backend, config))
        self.base_url = f"http://127.0.0.1:{self.frontends.http_port}"
        self.grpc_target = f"127.0.0.1:{self.frontends.grpc_port}"

    def call(self, coro, timeout=10):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def client(self, api_key="unused"):
        return openai.OpenAI(base_url=self.base_url + "/v1", api_key=api_key, max_retries=0, timeout=10)

    def get(self, path, headers=None) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(urllib.request.Request(self.base_url + path, headers=headers or {}),
                                        timeout=10) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def post(self, path, body: bytes, headers=None) -> tuple[int, dict]:
        request = urllib.request.Request(self.base_url + path, data=body, method="POST",
                                         headers={"Content-Type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(request, timeout=10) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def scrape(self) -> dict:
        """{(sample name, ((label, value), ...)): value} from /metrics; every sample's model_name label is the
        served model's (checked here, then left out of the key)."""
        status, text = self.get("/metrics")
        assert status == 200
        samples = [s for family in text_string_to_metric_families(text.decode()) for s in family.samples]
        assert all(s.labels.get("model_name") == self.backend.model_name for s in samples), \
            [s.name for s in samples if s.labels.get("model_name") != self.backend.model_name]
        return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
                for s in samples}

    def close(self):
        try:
            self.call(self.frontends.stop(0), timeout=30)  # a loaded machine (CI) can take a while
        except TimeoutError:  # say where it is stuck before failing: every thread, and the loop's tasks
            faulthandler.dump_traceback(sys.stderr)
            for task in asyncio.all_tasks(self.loop):
                # not task.print_stack: it fails on frames of compiled (Cython) coroutines, whose line is None
                print(f"task {task!r}", file=sys.stderr)
                for frame in task.get_stack():
                    print(f"  {frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}", file=sys.stderr)
            raise
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture(scope="module")
def echo_http():
    server = ServedFrontends(EchoBackend())
    yield server
    server.close()


@pytest.fixture
def served(echo_http):
    echo_http.backend.reset()
    yield echo_http
    wait_for(lambda: not echo_http.backend.running)  # every request ended in the backend


# ---- completions ------------------------------------------------------------------
def test_completion(served):
    c = served.client().completions.create(model="echo", prompt="hello world", max_tokens=10)
    assert c.object == "text_completion" and c.id.startswith("cmpl-") and c.model == "echo"
    (choice,) = c.choices
    assert choice.text == "<s> hello world " and choice.finish_reason == "stop" and choice.logprobs is None
    assert (c.usage.prompt_tokens, c.usage.completion_tokens, c.usage.total_tokens) == (3, 3, 6)
    assert c.usage.prompt_tokens_details.cached_tokens == 2


def test_prompt_forms_and_length(served):
    client = served.client()
    assert client.completions.create(model="echo", prompt=["hello"], max_tokens=5).choices[0].text == "<s> hello "
    by_ids = client.completions.create(model="echo", prompt=[6, 7, 8], max_tokens=2)
    assert by_ids.choices[0].text == "hello world " and by_ids.choices[0].finish_reason == "length"
    assert [r.prompt_token_ids for r in served.backend.requests] == [[1, 6], [6, 7, 8]]


def test_completion_stream_with_usage(served):
    stream = served.client().completions.create(model="echo", prompt="hello world the", max_tokens=3, stream=True,
                                                stream_options={"include_usage": True})
    chunks = list(stream)
    *text_chunks, last = chunks
    assert "".join(c.choices[0].text for c in text_chunks) == "<s> hello world "
    assert [c.choices[0].finish_reason for c in text_chunks] == [None, None, "length"]
    assert all(c.usage is None for c in text_chunks)
    assert last.choices == [] and (last.usage.prompt_tokens, last.usage.completion_tokens) == (4, 3)
    assert len({c.id for c in chunks}) == 1


def test_completion_stream_without_usage(served):
    chunks = list(served.client().completions.create(model="echo", prompt="hello", max_tokens=5, stream=True))
    assert [c.choices[0].text for c in chunks] == ["<s> ", "hello "]
    assert chunks[-1].choices[0].finish_reason == "stop" and all(c.usage is None for c in chunks)


def test_kvrelay_timeline_extension(served):
    want = {"routed_s": pytest.approx(0.001), "prefill_end_s": pytest.approx(0.01), "finish_s": pytest.approx(0.02)}
    status, body = served.post("/v1/completions", json.dumps(
        {"prompt": "hello world", "max_tokens": 2, "kvrelay_timeline": True}).encode())
    assert status == 200 and body["kvrelay_timeline"] == want
    status, body = served.post("/v1/chat/completions", json.dumps(
        {"messages": CHAT, "max_tokens": 2}).encode())
    assert status == 200 and "kvrelay_timeline" not in body
    chunks = list(served.client().chat.completions.create(
        model="echo", messages=CHAT, max_tokens=2, stream=True, extra_body={"kvrelay_timeline": True}))
    assert [c.model_extra.get("kvrelay_timeline") for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].model_extra["kvrelay_timeline"] == want
    status, body = served.post("/v1/completions", json.dumps(
        {"prompt": "hello", "kvrelay_timeline": "yes"}).encode())
    assert status == 400 and body["error"]["param"] == "kvrelay_timeline"


def test_sampling_params_reach_the_backend(served):
    client = served.client()
    client.completions.create(model="echo", prompt=[6, 7], max_tokens=2, temperature=0.5, top_p=0.9, seed=7,
                              stop="cat", user="someone",
                              extra_body={"top_k": 0, "min_p": 0.1, "stop_token_ids": [2], "ignore_eos": True})
    client.completions.create(model="echo", prompt="hello", stop=["cat", "mat"])
    client.chat.completions.create(model="echo", messages=CHAT, max_completion_tokens=3)
    first, second, chat = served.backend.requests
    s = first.sampling
    assert (s.max_tokens, s.top_k, s.seed, s.stop, s.stop_token_ids, s.ignore_eos) == (2, -1, 7, ("cat",), (2,), True)
    assert s.temperature == pytest.approx(0.5) and s.top_p == pytest.approx(0.9) and s.min_p == pytest.approx(0.1)
    assert second.sampling.stop == ("cat", "mat")
    assert second.sampling.max_tokens == EchoBackend.max_model_len - 2  # the rest of the context
    assert chat.sampling.max_tokens == 3


# ---- chat ---------------------------------------------------------------------------
def test_chat(served):
    c = served.client().chat.completions.create(model="echo", messages=CHAT, max_tokens=20)
    assert served.backend.requests[0].prompt_token_ids == CHAT_IDS  # template, BOS once
    assert c.object == "chat.completion" and c.id.startswith("chatcmpl-")
    (choice,) = c.choices
    assert choice.message.role == "assistant" and choice.finish_reason == "stop"
    assert choice.message.content == "<s> <|system|> a cat <|user|> hello <|assistant|> "
    assert (c.usage.prompt_tokens, c.usage.completion_tokens, c.usage.total_tokens) == (7, 7, 14)


def test_chat_text_parts(served):
    messages = [{"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "cat"}]}]
    served.client().chat.completions.create(model="echo", messages=messages, max_tokens=2)
    assert served.backend.requests[0].prompt_token_ids == [1, 4, 6, 9, 5]


def test_chat_stream_with_usage(served):
    stream = served.client().chat.completions.create(model="echo", messages=CHAT, max_tokens=3, stream=True,
                                                     stream_options={"include_usage": True})
    *chunks, last = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content for c in chunks) == "<s> <|system|> a "
    assert chunks[-1].choices[0].finish_reason == "length"
    assert last.choices == [] and (last.usage.prompt_tokens, last.usage.completion_tokens) == (7, 3)


# ---- logprobs -----------------------------------------------------------------------
def test_completion_logprobs(served):
    c = served.client().completions.create(model="echo", prompt="hello world", max_tokens=3, logprobs=2)
    lp = c.choices[0].logprobs
    assert lp.tokens == ["<s>", "hello", "world"] and lp.token_logprobs == [-0.5] * 3
    assert lp.top_logprobs == [{"<unk>": -1.0, "<s>": -2.0}] * 3
    assert lp.text_offset == [0, 3, 8]
    stream = served.client().completions.create(model="echo", prompt="hello world", max_tokens=3, logprobs=0,
                                                stream=True)
    offsets = [c.choices[0].logprobs.text_offset for c in stream]
    assert offsets == [[0], [4], [10]]  # offsets in the streamed text ("<s> hello world ")


def test_chat_logprobs(served):
    c = served.client().chat.completions.create(model="echo", messages=CHAT, max_tokens=2, logprobs=True,
                                                top_logprobs=3)
    content = c.choices[0].logprobs.content
    assert [t.token for t in content] == ["<s>", "<|system|>"] and [t.logprob for t in content] == [-0.5, -0.5]
    assert [t.token for t in content[0].top_logprobs] == ["<unk>", "<s>", "</s>"]
    assert content[1].bytes == list(b"<|system|>")
    plain = served.client().chat.completions.create(model="echo", messages=CHAT, max_tokens=1)
    assert plain.choices[0].logprobs is None
    assert [r.sampling.logprobs for r in served.backend.requests] == [3, None]


# ---- errors -------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, param, message", [
    (dict(prompt="hello", max_tokens=0), "max_tokens", "max_tokens: must be >= 1, got 0"),
    (dict(prompt="hello", max_tokens=100), "max_tokens", "max_tokens: 100 plus the prompt's 2 tokens exceed"),
    (dict(prompt="hello", temperature=-1), "temperature", "temperature: must be >= 0"),
    (dict(prompt="hello", n=17), "n", "n: must be in [1, 16], got 17"),
    (dict(prompt=["hello"] * 129, n=2), "n", "n: 129 prompts times n=2 is more than 256 choices"),
    (dict(prompt=["hello"] * 257), "prompt", "prompt: 257 prompts times n=1 is more than 256 choices"),
    (dict(prompt="hello", top_p=1.5), "top_p", "top_p: must be in (0, 1]"),
    (dict(prompt="hello", logprobs=21), "logprobs", "logprobs: must be in [0, 20]"),
    (dict(prompt="hello", stop=[""]), "stop", "stop: strings must not be empty"),
    (dict(prompt="hello", stop=[1]), "stop", "stop: must be a string or a list of strings"),
    (dict(prompt="hello", presence_penalty=2.5), "presence_penalty", "presence_penalty: must be in [-2, 2]"),
    (dict(prompt="hello", extra_body={"some_future_field": {"x": 1}}), "some_future_field",
     "some_future_field: not supported by this server"),
    (dict(prompt="hello", logit_bias={"cat": 5}), "logit_bias", "logit_bias: keys must be token ids, got 'cat'"),
    (dict(prompt="hello", logit_bias={"99": 5}), "logit_bias", "logit_bias: token id 99 is outside the vocabulary"),
    (dict(prompt="hello", extra_body={"prompt_logprobs": 21}), "prompt_logprobs",
     "prompt_logprobs: must be in [0, 20], got 21"),
    (dict(prompt="hello", echo=True, logprobs=21), "logprobs", "logprobs: must be in [0, 20], got 21"),
    (dict(prompt=""), "prompt", "prompt: must not be empty"),
    (dict(prompt=[]), "prompt", "prompt: must not be empty"),
    (dict(prompt=["hello", []]), "prompt[1]", "prompt[1]: must be a string or a non-empty list of token ids"),
    (dict(prompt=[6, 14]), "prompt", "prompt: token id 14 is outside the vocabulary"),
    (dict(prompt={"text": "hello"}), "prompt", "prompt: must be a string, a list of token ids, or a list of either"),
    (dict(prompt="hello", temperature="hot"), "temperature", "temperature: input should be a valid number"),
    (dict(prompt="hello", max_tokens=True), "max_tokens", "max_tokens: input should be a valid integer"),
    (dict(prompt="hello", extra_body={"stop_token_ids": [2, "x"]}), "stop_token_ids[1]", "stop_token_ids[1]: "),
    (dict(prompt="hello", extra_body={"top_k": -2}), "top_k", "top_k: must be >= 1, or 0 or -1 to disable"),
])
def test_invalid_completions_name_the_field(served, kwargs, param, message):
    with pytest.raises(openai.BadRequestError) as info:
        served.client().completions.create(model="echo", **kwargs)
    assert info.value.status_code == 400 and info.value.param == param
    assert info.value.type == "invalid_request_error"
    assert info.value.body["message"].startswith(message)
    assert not served.backend.requests


@pytest.mark.parametrize("kwargs, param, message", [
    (dict(messages=[]), "messages", "messages: must hold at least one message"),
    (dict(messages=[{"role": "user"}], max_completion_tokens=0), "max_completion_tokens",
     "max_completion_tokens: must be >= 1"),
    (dict(messages=[{"content": "hello"}]), "messages[0].role", "messages[0].role: field required"),
    (dict(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), "messages[0].content",
     "messages[0].content: only text parts are supported"),
    (dict(messages=CHAT, logprobs=True, top_logprobs=21), "top_logprobs", "top_logprobs: must be in [0, 20]"),
    (dict(messages=CHAT, top_logprobs=2), "top_logprobs", "top_logprobs: needs logprobs set to true"),
    (dict(messages=CHAT, n=0), "n", "n: must be in [1, 16], got 0"),
    (dict(messages=CHAT, store=True), "store", "store: not supported by this server"),
    (dict(messages=CHAT, modalities=["text", "audio"]), "modalities", "modalities: only [\"text\"] is supported"),
])
def test_invalid_chats_name_the_field(served, kwargs, param, message):
    with pytest.raises(openai.BadRequestError) as info:
        served.client().chat.completions.create(model="echo", **kwargs)
    assert info.value.param == param and info.value.body["message"].startswith(message)
    assert not served.backend.requests


def test_malformed_bodies(served):
    for body, param in ((b"{not json", "body"), (b"[1, 2]", "body"), (b"{}", "prompt")):
        status, reply = served.post("/v1/completions", body)
        assert status == 400 and reply["error"]["param"] == param, reply
    status, reply = served.post("/v1/nowhere", b"{}")
    assert status == 404 and set(reply["error"]) == {"message", "type", "param", "code"}
    assert not served.backend.requests


def test_unknown_model_is_404(served):
    with pytest.raises(openai.NotFoundError) as info:
        served.client().completions.create(model="gpt-4", prompt="hello")
    assert info.value.code == "model_not_found" and info.value.param == "model"
    assert "unknown model 'gpt-4'" in info.value.message
    with pytest.raises(openai.NotFoundError):
        served.client().models.retrieve("gpt-4")


def test_overload_is_429(served):
    served.backend.overloaded = True
    client = served.client()
    with pytest.raises(openai.RateLimitError) as info:
        client.completions.create(model="echo", prompt="hello")
    assert info.value.status_code == 429 and "busy" in info.value.message
    with pytest.raises(openai.RateLimitError):  # a stream is refused before it starts
        client.chat.completions.create(model="echo", messages=CHAT, stream=True)


def test_no_replica_is_503(served):
    served.backend.no_replica = True
    with pytest.raises(openai.InternalServerError) as info:
        served.client().completions.create(model="echo", prompt="hello", stream=True)
    assert info.value.status_code == 503 and info.value.code == "no_replica"
    status, body = served.get("/health")
    assert status == 503 and json.loads(body)["status"] == "unavailable"


def test_failure_mid_request(served):
    served.backend.fail_after = 1
    client = served.client()
    with pytest.raises(openai.InternalServerError) as info:
        client.completions.create(model="echo", prompt="hello world")
    assert info.value.status_code == 503 and "replica d0 died" in info.value.message
    got = []
    with pytest.raises(openai.APIError, match="replica d0 died"):
        for chunk in client.completions.create(model="echo", prompt="hello world", stream=True):
            got.append(chunk.choices[0].text)
    assert got == ["<s> "]
    ids = [r.request_id for r in served.backend.requests]
    wait_for(lambda: served.backend.aborted == ids)


def test_client_disconnect_aborts_the_request(served):
    served.backend.delay_s = 0.05
    stream = served.client().completions.create(model="echo", prompt="hello", max_tokens=50, stream=True,
                                                extra_body={"ignore_eos": True})
    first = next(iter(stream))
    assert first.choices[0].text == "<s> "
    stream.close()
    (req,) = served.backend.requests
    wait_for(lambda: served.backend.aborted == [req.request_id])
    wait_for(lambda: not served.backend.running)


# ---- models, health, auth -----------------------------------------------------------
def test_models_and_health(served):
    (model,) = served.client().models.list().data
    assert (model.id, model.object, model.owned_by) == ("echo", "model", "kvrelay")
    assert served.client().models.retrieve("echo").id == "echo"
    status, body = served.get("/health")
    assert status == 200 and json.loads(body) == {"status": "ok"}


def test_api_keys():
    server = ServedFrontends(EchoBackend(), api_keys=("k-alpha", "k-beta"))
    try:
        with pytest.raises(openai.AuthenticationError) as info:
            server.client("wrong").completions.create(model="echo", prompt="hello")
        assert info.value.status_code == 401 and info.value.body["message"] == "invalid API key"
        with pytest.raises(openai.AuthenticationError):
            server.client("wrong").models.list()
        status, reply = server.post("/v1/chat/completions", json.dumps({"messages": CHAT}).encode())
        assert status == 401 and reply["error"]["message"].startswith("missing API key")
        assert server.client("k-beta").completions.create(model="echo", prompt="hello").choices[0].text == "<s> hello "
        assert server.get("/health")[0] == 200 and server.get("/metrics")[0] == 200  # no key needed
        assert len(server.backend.requests) == 1  # refused calls never reach the backend
        assert server.scrape()[("kvrelay_requests_total", (("frontend", "http"), ("outcome", "unauthenticated")))] == 2
    finally:
        server.close()


# ---- metrics ------------------------------------------------------------------------
def _count(samples, name, **labels):
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_after_requests(served):
    before = served.scrape()
    client = served.client()
    client.completions.create(model="echo", prompt="hello world the", max_tokens=10)
    list(client.chat.completions.create(model="echo", messages=CHAT, max_tokens=3, stream=True))
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="echo", prompt="hello", max_tokens=0)
    served.backend.overloaded = True
    with pytest.raises(openai.RateLimitError):
        client.completions.create(model="echo", prompt="hello")
    after = served.scrape()

    def grew(name, **labels):
        return _count(after, name, **labels) - _count(before, name, **labels)

    assert grew("kvrelay_requests_total", frontend="http", outcome="stop") == 1
    assert grew("kvrelay_requests_total", frontend="http", outcome="length") == 1
    assert grew("kvrelay_requests_total", frontend="http", outcome="invalid_request") == 1
    assert grew("kvrelay_requests_total", frontend="http", outcome="overloaded") == 1
    assert grew("kvrelay_prompt_tokens_total") == 4 + 7 and grew("kvrelay_generation_tokens_total") == 4 + 3
    assert grew("kvrelay_time_to_first_token_seconds_count") == 2
    assert grew("kvrelay_inter_token_latency_seconds_count") == 3 + 2
    assert grew("kvrelay_e2e_request_latency_seconds_count") == 2
    for name in ("queue_time", "prefill_time", "kv_transfer_time"):  # from the last delta's StageMetrics
        assert grew(f"kvrelay_{name}_seconds_count") == 2
    assert grew("kvrelay_kv_transfer_bytes_total") == 2 * 4096
    assert _count(after, "kvrelay_time_to_first_token_seconds_bucket", le="+Inf") >= 2
    assert "kvrelay_kv_transfer_failures_total" in {name for name, _ in after}
    assert _count(after, "kvrelay_replica_up", stage="colocated", replica="c0") == 1
    assert _count(after, "kvrelay_replica_up", stage="colocated", replica="c1") == 0
    assert _count(after, "kvrelay_replica_kv_usage_ratio", stage="colocated", replica="c0") == pytest.approx(0.25)
    dead = (("replica", "c1"), ("stage", "colocated"))  # c1's stale report (7 running, 90% KV) is left out
    assert [name for name, labels in after if labels == dead] == ["kvrelay_replica_up"]
    assert _count(after, "kvrelay_requests_in_flight", frontend="http") == 0
    assert ("kvrelay_router_waiting_requests", ()) in after
    # per finished request (stop and length; not the refused ones): lengths, decode time and TPOT
    assert grew("kvrelay_request_prompt_tokens_sum") == 4 + 7 and grew("kvrelay_request_prompt_tokens_count") == 2
    assert grew("kvrelay_request_generation_tokens_sum") == 4 + 3
    assert grew("kvrelay_request_decode_time_seconds_count") == 2
    assert grew("kvrelay_request_time_per_output_token_seconds_count") == 2
    assert _count(after, "kvrelay_replica_kv_blocks", stage="colocated", replica="c0") == 100


def test_grpc_records_into_the_same_metrics(served):
    before = served.scrape()
    with KVRelayClient(served.grpc_target) as client:
        client.generate("hello world", max_tokens=2)
        with pytest.raises(KVRelayError):
            client.generate("hello", top_p=2.0)
    after = served.scrape()
    assert _count(after, "kvrelay_requests_total", frontend="grpc", outcome="length") - \
        _count(before, "kvrelay_requests_total", frontend="grpc", outcome="length") == 1
    assert _count(after, "kvrelay_requests_total", frontend="grpc", outcome="invalid_request") - \
        _count(before, "kvrelay_requests_total", frontend="grpc", outcome="invalid_request") == 1
    assert _count(after, "kvrelay_time_to_first_token_seconds_count") - \
        _count(before, "kvrelay_time_to_first_token_seconds_count") == 1


def test_client_timeout_aborts_a_non_streaming_request(served):
    served.backend.delay_s = 0.05
    client = openai.OpenAI(base_url=served.base_url + "/v1", api_key="unused", max_retries=0, timeout=0.3)
    with pytest.raises(openai.APITimeoutError):
        client.completions.create(model="echo", prompt="hello", max_tokens=50, extra_body={"ignore_eos": True})
    (req,) = served.backend.requests
    wait_for(lambda: served.backend.aborted == [req.request_id])


def test_stop_aborts_requests_still_running():
    server = ServedFrontends(EchoBackend())
    try:
        server.backend.delay_s = 0.05
        stream = server.client().completions.create(model="echo", prompt="hello", max_tokens=60, stream=True,
                                                    extra_body={"ignore_eos": True})
        next(iter(stream))
        started = time.monotonic()
        server.call(server.frontends.stop(0.1))
        assert time.monotonic() - started < 2
        rest = []
        with contextlib.suppress(openai.APIError):  # the connection is cut mid-stream
            rest.extend(stream)
        assert all(c.choices[0].finish_reason is None for c in rest) and len(rest) < 59
        (req,) = server.backend.requests
        wait_for(lambda: server.backend.aborted == [req.request_id] and not server.backend.running)
    finally:
        server.close()


def test_tls(tls_cert):
    cert, key = tls_cert
    server = ServedFrontends(EchoBackend(), tls_cert_file=str(cert), tls_key_file=str(key))
    try:
        base_url = f"https://127.0.0.1:{server.frontends.http_port}/v1"
        with openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=str(cert))) as http_client:
            client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=10,
                                   http_client=http_client)
            assert client.completions.create(model="echo", prompt="hello").choices[0].text == "<s> hello "
    finally:
        server.close()
