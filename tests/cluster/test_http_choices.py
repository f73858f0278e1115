"""Several choices per response (a list of prompts, n > 1), echo, and
/tokenize and /detokenize, through the official `openai` client over the
EchoBackend (which echoes the prompt's tokens, one per delta)."""
from __future__ import annotations

import json
import urllib.request

import openai
import pytest

from tests.cluster.conftest import EchoBackend
from tests.cluster.test_http import CHAT, ServedFrontends, echo_http, served  # noqa: F401  (echo_http, served: fixtures)


def test_a_list_of_prompts_gets_one_choice_each_in_order_and_summed_usage(served):
    r = served.client().completions.create(model="echo", prompt=["hello world", [1, 8, 9, 10], "cat"], max_tokens=8)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == ["<s> hello world ", "<s> the cat sat ", "<s> cat "]
    assert [c.finish_reason for c in r.choices] == ["stop"] * 3
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (3 + 4 + 2, 3 + 4 + 2)
    assert sorted(len(q.prompt_token_ids) for q in served.backend.requests) == [2, 3, 4]
    assert len({q.request_id for q in served.backend.requests}) == 3


def test_n_gives_n_choices_per_prompt_each_seeded_on_its_own(served):
    r = served.client().completions.create(model="echo", prompt=["hello", "cat"], n=2, max_tokens=4, seed=11)
    assert [(c.index, c.text) for c in r.choices] == [(0, "<s> hello "), (1, "<s> hello "), (2, "<s> cat "),
                                                      (3, "<s> cat ")]
    assert r.usage.prompt_tokens == 4 and r.usage.completion_tokens == 8  # each prompt counted once
    seeds = {q.request_id[-1]: q.sampling.seed for q in served.backend.requests}
    assert seeds["0"] == 11 and seeds["1"] not in (None, 11)  # choice 0 is what n=1 gives; choice 1 its own stream
    chat = served.client().chat.completions.create(model="echo", messages=CHAT, n=3, max_tokens=2)
    assert [c.index for c in chat.choices] == [0, 1, 2]
    assert len({c.message.content for c in chat.choices}) == 1 and chat.usage.completion_tokens == 6


def test_streamed_choices_carry_their_index_and_end_with_one_usage_chunk(served):
    chunks = list(served.client().completions.create(
        model="echo", prompt=["hello world", "cat"], max_tokens=8, stream=True, stream_options={"include_usage": True}))
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    for c in chunks[:-1]:
        (choice,) = c.choices
        texts[choice.index] = texts.get(choice.index, "") + choice.text
        if choice.finish_reason:
            assert choice.index not in finishes
            finishes[choice.index] = choice.finish_reason
    assert texts == {0: "<s> hello world ", 1: "<s> cat "} and finishes == {0: "stop", 1: "stop"}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5


def test_echo_puts_the_prompt_before_the_completion(served):
    client = served.client()
    r = client.completions.create(model="echo", prompt="hello world", max_tokens=2, echo=True)
    assert r.choices[0].text == "hello world<s> hello "
    assert r.usage.prompt_tokens == 3 and r.usage.completion_tokens == 2
    ids = client.completions.create(model="echo", prompt=[1, 8, 9], max_tokens=1, echo=True)
    assert ids.choices[0].text == "<s> the cat<s> "
    streamed = client.completions.create(model="echo", prompt="cat", max_tokens=2, echo=True, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == "cat<s> cat "


@pytest.mark.parametrize("stream", [False, True])
def test_more_choices_than_the_replicas_hold_at_once_all_finish(served, stream):
    """12 prompts with n=2 (24 choices) where the backend serves 4 requests at once, each holding its
    place until its stream is read to the end: every choice is read from the start, so each frees its
    place for the next one, and none waits on how far the response has read another (lm-evaluation-harness
    sends lists of 32 or 64 prompts)."""
    served.backend.capacity = 4
    served.backend.delay_s = 0.005
    prompts = ["hello world", "cat"] * 6
    r = served.client().completions.create(model="echo", prompt=prompts, n=2, max_tokens=4, stream=stream)
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    for c in (r.choices if not stream else [c for chunk in r for c in chunk.choices]):
        texts[c.index] = texts.get(c.index, "") + c.text
        reasons[c.index] = c.finish_reason or reasons.get(c.index)
    assert sorted(texts) == list(range(24))
    assert [texts[i] for i in range(24)] == [t for p in prompts for t in [f"<s> {p} "] * 2]
    assert set(reasons.values()) == {"stop"}
    assert len(served.backend.requests) == 24


def test_a_refused_choice_refuses_the_whole_response(served):
    with pytest.raises(openai.BadRequestError) as info:
        served.client().completions.create(model="echo", prompt=["hello", [6, 99]], max_tokens=2)
    assert info.value.param == "prompt" and "token id 99" in info.value.message
    assert not served.backend.requests


def test_a_failing_choice_fails_the_response_and_the_others_are_aborted(served):
    served.backend.delay_s = 0.02
    served.backend.error_after = 3
    with pytest.raises(openai.APIStatusError) as info:
        served.client().completions.create(model="echo", prompt=["hello world the cat", "cat"], n=2,
                                           max_tokens=20, extra_body={"ignore_eos": True})
    assert info.value.status_code == 503


# ---- /tokenize and /detokenize --------------------------------------------------

def _post(served, path, body) -> tuple[int, dict]:
    return served.post(path, json.dumps(body).encode())


def test_tokenize_a_prompt_and_a_chat_as_a_completion_would(served):
    status, r = _post(served, "/tokenize", {"model": "echo", "prompt": "hello cat"})
    assert status == 200 and r == {"count": 3, "max_model_len": EchoBackend.max_model_len, "tokens": [1, 6, 9],
                                   "token_strs": None}
    status, r = _post(served, "/tokenize", {"prompt": "hello cat", "add_special_tokens": False,
                                            "return_token_strs": True})
    assert r["tokens"] == [6, 9] and r["token_strs"] == ["hello", "cat"]
    status, r = _post(served, "/tokenize", {"messages": CHAT})
    assert status == 200 and r["tokens"] == [1, 3, 12, 9, 4, 6, 5]  # the chat template's ids, one BOS
    status, r = _post(served, "/tokenize", {"messages": CHAT, "add_generation_prompt": False})
    assert r["tokens"] == [1, 3, 12, 9, 4, 6]


def test_detokenize(served):
    status, r = _post(served, "/detokenize", {"model": "echo", "tokens": [1, 6, 7]})
    assert status == 200 and r == {"prompt": "<s> hello world"}


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {"prompt": "hello", "messages": CHAT}, "prompt"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "hello", "chat_template": "x"}, "chat_template"),
    ("/tokenize", {"prompt": "hello", "model": "gpt-4"}, "model"),
    ("/detokenize", {"tokens": [1, 99]}, "tokens[1]"),
    ("/detokenize", {"tokens": ["a"]}, "tokens[0]"),
])
def test_bad_tokenization_requests_name_the_field(served, path, body, param):
    status, r = _post(served, path, body)
    assert status == (404 if param == "model" else 400) and r["error"]["param"] == param, r


def test_tokenization_needs_the_key_when_keys_are_set():
    server = ServedFrontends(EchoBackend(), api_keys=["k1"])
    try:
        request = urllib.request.Request(server.base_url + "/tokenize", data=b'{"prompt": "hello"}', method="POST")
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(request, timeout=10)
        assert info.value.code == 401
        status, r = server.post("/tokenize", b'{"prompt": "hello"}', headers={"Authorization": "Bearer k1"})
        assert status == 200 and r["tokens"] == [1, 6]
    finally:
        server.close()
