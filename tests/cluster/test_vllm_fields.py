"""vLLM's request extras on both frontends: min_tokens, include_stop_str_in_output,
skip_special_tokens, allowed_token_ids, truncate_prompt_tokens and bad_words (as token sequences) reach the backend
as the client set them, and a bad one is refused by name before the backend sees it."""
from __future__ import annotations

import grpc
import openai
import pytest

from cluster.client import KVRelayClient, KVRelayError
from tests.cluster.test_http import ServedFrontends
from tests.cluster.conftest import EchoBackend, ServedFrontend


@pytest.fixture(scope="module")
def http():
    server = ServedFrontends(EchoBackend())
    yield server
    server.close()


@pytest.fixture(scope="module")
def rpc():
    server = ServedFrontend(EchoBackend())
    yield server
    server.close()


EXTRAS = {"min_tokens": 2, "include_stop_str_in_output": True, "skip_special_tokens": False,
          "allowed_token_ids": [9, 7, 9], "bad_words": ["cat", " the cat "]}


def _extras(sampling) -> dict:
    return {name: getattr(sampling, name if name != "bad_words" else "bad_words_token_ids") for name in EXTRAS}


def test_the_extras_reach_the_backend(http, rpc):
    http.backend.reset()
    http.client().completions.create(model="echo", prompt="hello world the cat", max_tokens=3, extra_body=EXTRAS)
    # "cat" and " cat" are one word to the frontends' word-level tokenizer: one sequence
    want = dict(EXTRAS, allowed_token_ids=(7, 9), bad_words=((9,), (8, 9)))
    assert _extras(http.backend.requests[-1].sampling) == want
    http.client().completions.create(model="echo", prompt="hello world the cat", max_tokens=3,
                                     extra_body={"truncate_prompt_tokens": 2})
    assert http.backend.requests[-1].prompt_token_ids == [8, 9]  # "the cat", the last two of "<s> hello world the cat"
    http.client().chat.completions.create(model="echo", messages=[{"role": "user", "content": "hello"}],
                                          max_tokens=3, extra_body=EXTRAS)
    assert _extras(http.backend.requests[-1].sampling) == want
    rpc.backend.reset()
    with KVRelayClient(rpc.target) as client:
        client.generate("hello world", max_tokens=3, **EXTRAS)
        assert _extras(rpc.backend.requests[-1].sampling) == want
        client.generate("hello world the cat", max_tokens=3, truncate_prompt_tokens=2)
        assert rpc.backend.requests[-1].prompt_token_ids == [8, 9]
        client.generate(token_ids=[5, 6, 7], max_tokens=3, truncate_prompt_tokens=-1)  # (fits the context whole)
        assert rpc.backend.requests[-1].prompt_token_ids == [5, 6, 7]
        client.generate("hello world", max_tokens=3)
    assert _extras(rpc.backend.requests[-1].sampling) == {"min_tokens": 0, "include_stop_str_in_output": False,
                                                          "skip_special_tokens": True, "allowed_token_ids": None,
                                                          "bad_words": ()}


@pytest.mark.parametrize("extra, param, message", [
    ({"min_tokens": 6}, "min_tokens", "min_tokens: must be in [0, max_tokens=5], got 6"),
    ({"min_tokens": -1}, "min_tokens", "min_tokens: must be in [0, max_tokens=5], got -1"),
    ({"allowed_token_ids": []}, "allowed_token_ids", "allowed_token_ids: must not be empty"),
    ({"allowed_token_ids": [3, 99]}, "allowed_token_ids", "allowed_token_ids: token id 99 is outside the vocabulary"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "truncate_prompt_tokens: must be >= 1, or -1"),
    ({"bad_words": "cat"}, "bad_words", "bad_words: must be a list of non-empty strings, got 'cat'"),
    ({"bad_words": ["cat", " "]}, "bad_words", "bad_words: must be a list of non-empty strings"),
    ({"bad_words": ["cat"] * 129}, "bad_words", "bad_words: at most 128 words, got 129"),
    ({"min_tokens": 1, "guided_regex": "hello"}, "min_tokens", "min_tokens: cannot be combined with guided_regex"),
    ({"skip_special_tokens": "no"}, "skip_special_tokens", "skip_special_tokens: input should be a valid boolean"),
])
def test_bad_extras_are_refused_by_name(http, extra, param, message):
    http.backend.reset()
    with pytest.raises(openai.BadRequestError) as info:
        http.client().completions.create(model="echo", prompt="hello", max_tokens=5, extra_body=extra)
    assert info.value.param == param and info.value.body["message"].startswith(message)
    assert not http.backend.requests


def test_grpc_refuses_bad_extras_by_name(rpc):
    with KVRelayClient(rpc.target) as client:
        for kw, message in ((dict(min_tokens=9), "min_tokens: must be in [0, max_tokens=5], got 9"),
                            (dict(allowed_token_ids=[99]), "allowed_token_ids: token id 99 is outside"),
                            (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens: must be >= 1, or -1"),
                            (dict(bad_words=["cat", ""]), "bad_words: must be a list of non-empty strings")):
            with pytest.raises(KVRelayError) as e:
                client.generate("hello", max_tokens=5, **kw)
            assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and e.value.message.startswith(message)
