"""Every field of OpenAI's request schema for chat and completions is either
honoured (it reaches the backend as asked) or refused with a 400 that names
it; none is accepted and dropped. The tables below are the schema of the
current API (checked against the installed `openai` package's request types,
so a field a newer client sends fails here until it is decided on), over the
EchoBackend."""
from __future__ import annotations

import json

import pytest

from tests.cluster.conftest import EchoBackend
from tests.cluster.test_http import CHAT, ServedFrontends, wait_for

HONOURED, REFUSED = "honoured", "refused"
GUIDED = lambda reqs: len(reqs) == 1 and reqs[0].sampling.guided is not None  # noqa: E731  (cluster.structured)

# field -> (value to send, outcome, check of the backend's requests when honoured)
COMMON = {
    "model": ("echo", HONOURED, lambda reqs: len(reqs) == 1),
    "frequency_penalty": (0.5, HONOURED, lambda reqs: reqs[0].sampling.frequency_penalty == 0.5),
    "presence_penalty": (-0.5, HONOURED, lambda reqs: reqs[0].sampling.presence_penalty == -0.5),
    "logit_bias": ({"6": 1.5}, HONOURED, lambda reqs: reqs[0].sampling.logit_bias == ((6, 1.5),)),
    "max_tokens": (3, HONOURED, lambda reqs: reqs[0].sampling.max_tokens == 3),
    "n": (2, HONOURED, lambda reqs: len(reqs) == 2),
    "seed": (5, HONOURED, lambda reqs: reqs[0].sampling.seed == 5),
    "stop": ("cat", HONOURED, lambda reqs: reqs[0].sampling.stop == ("cat",)),
    "stream": (True, HONOURED, lambda reqs: len(reqs) == 1),
    "stream_options": ({"include_usage": True}, HONOURED, lambda reqs: len(reqs) == 1),  # sent with stream
    "temperature": (0.5, HONOURED, lambda reqs: reqs[0].sampling.temperature == 0.5),
    "top_p": (0.5, HONOURED, lambda reqs: reqs[0].sampling.top_p == 0.5),
    "user": ("someone", HONOURED, lambda reqs: len(reqs) == 1),  # an end-user id for the operator: no effect
}
CHAT_FIELDS = dict(COMMON, **{
    "messages": (CHAT, HONOURED, lambda reqs: reqs[0].prompt_token_ids[-1] == 5),  # <|assistant|>
    "logprobs": (True, HONOURED, lambda reqs: reqs[0].sampling.logprobs == 0),
    "top_logprobs": (2, HONOURED, lambda reqs: reqs[0].sampling.logprobs == 2),  # sent with logprobs
    "max_completion_tokens": (2, HONOURED, lambda reqs: reqs[0].sampling.max_tokens == 2),
    "modalities": (["text"], HONOURED, lambda reqs: len(reqs) == 1),
    "safety_identifier": ("someone", HONOURED, lambda reqs: len(reqs) == 1),
    "audio": ({"voice": "alloy", "format": "wav"}, REFUSED, None),
    "metadata": ({"k": "v"}, REFUSED, None),
    "moderation": ({"type": "auto"}, REFUSED, None),
    "prediction": ({"type": "content", "content": "hello"}, REFUSED, None),
    "prompt_cache_key": ("k", REFUSED, None),
    "prompt_cache_options": ({}, REFUSED, None),
    "prompt_cache_retention": ("24h", REFUSED, None),
    "reasoning_effort": ("low", REFUSED, None),
    "service_tier": ("auto", REFUSED, None),
    "store": (True, REFUSED, None),
    "verbosity": ("low", REFUSED, None),
    "web_search_options": ({}, REFUSED, None),
    "response_format": ({"type": "json_object"}, HONOURED, GUIDED),
    # the tools reach the chat template (cluster.tools; what each tool_choice does: tests/e2e/test_structured.py)
    "tools": ([{"type": "function", "function": {"name": "f", "parameters": {}}}], HONOURED,
              lambda reqs: len(reqs) == 1),
    "tool_choice": ("none", HONOURED, lambda reqs: len(reqs) == 1),
    "parallel_tool_calls": (False, HONOURED, lambda reqs: len(reqs) == 1),
    "functions": ([{"name": "f", "parameters": {}}], REFUSED, None),  # deprecated by OpenAI for tools
    "function_call": ("auto", REFUSED, None),
})
COMPLETION_FIELDS = dict(COMMON, **{
    "prompt": ("hello", HONOURED, lambda reqs: reqs[0].prompt_token_ids == [1, 6]),
    "logprobs": (2, HONOURED, lambda reqs: reqs[0].sampling.logprobs == 2),
    "echo": (True, HONOURED, lambda reqs: len(reqs) == 1),  # the text's prefix: test_http_choices
    "best_of": (2, REFUSED, None),
    "suffix": ("the end", REFUSED, None),
})
# vLLM's extensions that kvrelay serves
EXTENSIONS = {
    "top_k": (3, HONOURED, lambda reqs: reqs[0].sampling.top_k == 3),
    "min_p": (0.25, HONOURED, lambda reqs: reqs[0].sampling.min_p == 0.25),
    "repetition_penalty": (1.25, HONOURED, lambda reqs: reqs[0].sampling.repetition_penalty == 1.25),
    "stop_token_ids": ([2], HONOURED, lambda reqs: reqs[0].sampling.stop_token_ids == (2,)),
    "ignore_eos": (True, HONOURED, lambda reqs: reqs[0].sampling.ignore_eos),
    "kvrelay_timeline": (True, HONOURED, lambda reqs: reqs[0].timeline),
    "guided_json": ({"type": "object"}, HONOURED, GUIDED),
    "guided_regex": ("a+", HONOURED, GUIDED),
    "guided_choice": (["a", "b"], HONOURED, GUIDED),
    "guided_grammar": ("root ::= \"a\"", HONOURED, GUIDED),
    "structured_outputs": ({"regex": "a+"}, HONOURED, GUIDED),
    "some_future_field": (1, REFUSED, None),
}
ENDPOINTS = {"chat": ("/v1/chat/completions", CHAT_FIELDS, {"messages": CHAT}),
             "completions": ("/v1/completions", COMPLETION_FIELDS, {"prompt": "hello"})}
WITH = {"stream_options": {"stream": True}, "top_logprobs": {"logprobs": True}}  # fields that need a companion


def test_the_tables_cover_the_installed_openai_clients_request_schema():
    from openai.types import completion_create_params
    from openai.types.chat import completion_create_params as chat_create_params

    for table, params in ((CHAT_FIELDS, chat_create_params), (COMPLETION_FIELDS, completion_create_params)):
        schema = set(params.CompletionCreateParamsBase.__annotations__) | {"stream"}
        assert schema <= set(table), f"fields to decide on: {sorted(schema - set(table))}"


@pytest.fixture(scope="module")
def served():
    server = ServedFrontends(EchoBackend())
    yield server
    server.close()


CASES = [(ep, name) for ep, (_, table, _) in ENDPOINTS.items() for name in list(table) + list(EXTENSIONS)]


@pytest.mark.parametrize("endpoint, field", CASES, ids=[f"{e}.{f}" for e, f in CASES])
def test_each_field_is_honoured_or_refused_naming_it(served, endpoint, field):
    path, table, base = ENDPOINTS[endpoint]
    value, outcome, check = table.get(field) or EXTENSIONS[field]
    served.backend.reset()
    body = dict(base, model="echo", max_tokens=4, **WITH.get(field, {}))
    body[field] = value
    status, raw = _post(served, path, body)
    if outcome == HONOURED:
        assert status == 200, raw
        assert check(served.backend.requests), f"{field}={value!r} did not reach the backend as sent"
    else:
        reply = json.loads(raw)
        assert status == 400 and reply["error"]["param"] == field, reply
        assert field in reply["error"]["message"]
        assert not served.backend.requests
    wait_for(lambda: not served.backend.running)


def _post(served, path: str, body: dict) -> tuple[int, bytes]:
    import urllib.error
    import urllib.request

    request = urllib.request.Request(served.base_url + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
