"""The OpenAI request surface on a real served cluster (disaggregated over
gRPC, the real default model), through the official `openai` client:
penalties change the output as specified (checked against the model's own
logprobs, the first token included, which the prefill replica samples),
logit_bias forces and bans, n and a list of prompts give their choices.
Every pool is free afterwards."""
from __future__ import annotations

import json
import urllib.request
import uuid
from collections import Counter

import openai
import pytest

from tests.e2e.conftest import disagg_spec, running_cluster

PROMPT = "The cat sat on the mat. The cat sat on the mat. The cat"
STORY = "Once upon a time"  # its greedy continuation repeats a comma that a presence penalty of 2 outweighs
COLORS = "List the colors: red, blue, red, blue,"
TOP = 20


@pytest.fixture(scope="module")
def cluster(ray_instance):
    # no prefix cache on the prefill replica: the prompt blocks n's choices reuse can only come from the fork
    spec = disagg_spec(1, 1, "grpc")
    spec["prefill"]["enable_prefix_caching"] = False
    with running_cluster(spec) as rc:
        yield rc


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{cluster.http_port}/v1", api_key="unused", max_retries=0,
                         timeout=120)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def _greedy(client, model, prompt=PROMPT, **kw):
    return client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0, logprobs=TOP,
                                     extra_body={"ignore_eos": True, **kw.pop("extra_body", {})}, **kw).choices[0]


def _tokenize(cluster, text: str) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{cluster.http_port}/tokenize", method="POST",
                                     data=json.dumps({"prompt": text, "add_special_tokens": False,
                                                      "return_token_strs": True}).encode())
    with urllib.request.urlopen(request, timeout=30) as r:
        return json.loads(r.read())


def _chosen_is_the_penalized_argmax(choice, presence: float, frequency: float) -> None:
    """At every position the sampled token is the best of the model's top alternatives after subtracting, by
    hand, presence * [seen in the output so far] + frequency * (its count there): the logprobs returned are the
    model's, before the penalties, and a constant shift per row does not change an argmax."""
    tokens = choice.logprobs.tokens
    for i, (token, top) in enumerate(zip(tokens, choice.logprobs.top_logprobs)):
        counts = Counter(tokens[:i])
        score = {t: lp - presence * (counts[t] > 0) - frequency * counts[t] for t, lp in top.items()}
        best = max(score, key=score.get)
        assert token == best or score[token] == pytest.approx(score[best], abs=1e-4), (i, token, best)


def test_presence_penalty_changes_the_output_as_specified(client, model):
    plain = _greedy(client, model, STORY)
    assert len(set(plain.logprobs.tokens)) < len(plain.logprobs.tokens)  # it repeats itself
    penalized = _greedy(client, model, STORY, presence_penalty=2.0)
    assert penalized.logprobs.tokens != plain.logprobs.tokens
    _chosen_is_the_penalized_argmax(penalized, 2.0, 0.0)


def test_frequency_penalty_changes_the_output_as_specified(client, model):
    plain = _greedy(client, model, COLORS)
    penalized = _greedy(client, model, COLORS, frequency_penalty=1.5)
    assert penalized.logprobs.tokens != plain.logprobs.tokens
    _chosen_is_the_penalized_argmax(penalized, 0.0, 1.5)


def test_repetition_penalty_counts_the_prompt_too(client, model, cluster):
    plain = _greedy(client, model)
    assert plain.logprobs.tokens[0] == " sat"  # the prompt's own continuation
    # a huge penalty divides every positive logit of a token seen in prompt or output to about 0: the model's
    # confident picks (large positive logits) are then always new tokens
    fresh = _greedy(client, model, extra_body={"repetition_penalty": 1e6})
    tokens = fresh.logprobs.tokens
    assert len(set(tokens)) == len(tokens)
    assert not set(tokens) & set(_tokenize(cluster, PROMPT)["token_strs"])
    assert cluster.wait_pools_free() == {rid: True for rid in cluster.cluster.actors}


def test_logit_bias_forces_and_bans_a_token(client, model, cluster):
    (banana,) = _tokenize(cluster, " banana")["tokens"]
    forced = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0,
                                       logit_bias={str(banana): 100}, extra_body={"ignore_eos": True})
    assert forced.choices[0].text == " banana" * 6
    plain = _greedy(client, model)
    first = plain.logprobs.tokens[0]
    (first_id,) = _tokenize(cluster, first)["tokens"]
    banned = _greedy(client, model, logit_bias={str(first_id): -100})
    assert first not in banned.logprobs.tokens
    assert banned.logprobs.tokens[0] == max((t for t in plain.logprobs.top_logprobs[0] if t != first),
                                            key=plain.logprobs.top_logprobs[0].get)
    sampled = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=3,
                                        logit_bias={str(banana): 100})
    assert sampled.choices[0].text == " banana" * 8
    assert cluster.wait_pools_free() == {rid: True for rid in cluster.cluster.actors}


def test_n_and_a_list_of_prompts(client, model, cluster):
    greedy = client.completions.create(model=model, prompt=PROMPT, n=3, max_tokens=12, temperature=0)
    assert [c.index for c in greedy.choices] == [0, 1, 2] and len({c.text for c in greedy.choices}) == 1
    assert_forked(client, model)
    seeded = [client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Tell a story."}],
                                             n=3, max_tokens=12, temperature=1.0, seed=42) for _ in range(2)]
    texts = [[c.message.content for c in r.choices] for r in seeded]
    assert texts[0] == texts[1] and len(set(texts[0])) == 3  # reproducible, and three different draws
    both = client.completions.create(model=model, prompt=[PROMPT, "Paris is the capital of"], max_tokens=6,
                                     temperature=0)
    alone = client.completions.create(model=model, prompt="Paris is the capital of", max_tokens=6, temperature=0)
    assert [c.index for c in both.choices] == [0, 1] and both.choices[1].text == alone.choices[0].text
    assert both.usage.prompt_tokens == greedy.usage.prompt_tokens + alone.usage.prompt_tokens
    assert cluster.wait_pools_free() == {rid: True for rid in cluster.cluster.actors}


def assert_forked(client, model) -> None:
    """The choices after the first computed only the prompt's last partial block on the prefill (or colocated)
    replica, whose prefix cache is off: the prompt's full blocks are reported reused, which only the fork does."""
    prompt = f"{uuid.uuid4().hex} is a fresh prompt of some forty tokens, so that two full blocks of sixteen " \
             "are shared by the choices"
    r = client.completions.create(model=model, prompt=prompt, n=3, max_tokens=4, temperature=0)
    full = (r.usage.prompt_tokens - 1) // 16 * 16
    assert full >= 16 and r.usage.prompt_tokens_details.cached_tokens == full
    assert len({c.text for c in r.choices}) == 1


def test_the_responses_api_answers_as_a_chat_would(client, model, cluster):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color."}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=10, temperature=0)
    whole = client.responses.create(model=model, instructions="Be brief.", input="Name a color.",
                                    max_output_tokens=10, temperature=0)
    assert whole.output_text == chat.choices[0].message.content
    assert whole.usage.input_tokens == chat.usage.prompt_tokens
    events = list(client.responses.create(model=model, instructions="Be brief.", input="Name a color.",
                                          max_output_tokens=10, temperature=0, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert cluster.wait_pools_free() == {rid: True for rid in cluster.cluster.actors}


def test_vllm_sampling_extras(client, model, cluster):
    """min_tokens, include_stop_str_in_output, skip_special_tokens, allowed_token_ids, bad_words and
    truncate_prompt_tokens as vLLM's clients send them (extra_body), and over gRPC: the first token is the
    prefill replica's, the rest the decode replica's, and each keeps to them."""
    count = "Count: 1, 2, 3, 4, 5, 6, 7, 8"
    plain = _greedy(client, model, count, extra_body={"stop": [","]})
    assert plain.finish_reason == "stop" and "," not in plain.text
    kept = _greedy(client, model, count, extra_body={"stop": [","], "include_stop_str_in_output": True})
    assert kept.text == plain.text + ","
    late = _greedy(client, model, count, extra_body={"stop": [","], "min_tokens": 6})
    assert late.text.startswith(plain.text + ",") and len(late.logprobs.tokens) >= 6
    end = _tokenize(cluster, "<|im_end|>")["tokens"]
    assert len(end) == 1
    forced = dict(max_tokens=2, temperature=0, logit_bias={str(end[0]): 100}, extra_body={"ignore_eos": True})
    assert client.completions.create(model=model, prompt=count, **forced).choices[0].text == ""
    shown = client.completions.create(model=model, prompt=count, **dict(
        forced, extra_body={"ignore_eos": True, "skip_special_tokens": False}))
    assert shown.choices[0].text == "<|im_end|>" * 2
    allowed = [_tokenize(cluster, w)["tokens"][0] for w in (" red", " blue")]
    only = client.completions.create(model=model, prompt="Colors:", max_tokens=6, temperature=1.0, seed=1,
                                     extra_body={"allowed_token_ids": allowed})
    assert set(_tokenize(cluster, only.choices[0].text)["tokens"]) <= set(allowed)
    cut = client.completions.create(model=model, prompt=count, max_tokens=1, echo=True,
                                    extra_body={"truncate_prompt_tokens": 4})
    last4 = _tokenize(cluster, count)["tokens"][-4:]
    request = urllib.request.Request(f"http://127.0.0.1:{cluster.http_port}/detokenize", method="POST",
                                     data=json.dumps({"tokens": last4}).encode())
    with urllib.request.urlopen(request, timeout=30) as r:
        echoed = json.loads(r.read())["prompt"]
    assert cut.usage.prompt_tokens == 4 and len(echoed) < len(count) and cut.choices[0].text.startswith(echoed)
    out = cluster.client.generate(count, max_tokens=16, temperature=0, stop=[","], min_tokens=6,
                                  include_stop_str_in_output=True)
    assert out.text.startswith(plain.text + ",") and out.text.endswith(",")
    out = cluster.client.generate("Colors:", max_tokens=6, temperature=1.0, seed=1, allowed_token_ids=allowed)
    assert set(out.token_ids) <= set(allowed)
    out = cluster.client.generate(count, max_tokens=1, temperature=0, truncate_prompt_tokens=4)
    assert out.usage.prompt_tokens == 4
    # bad_words: the greedy output's second word, banned, is not in it any more (over HTTP and gRPC)
    word = _greedy(client, model, "The capital of France is").text.split()[1]
    avoided = _greedy(client, model, "The capital of France is", extra_body={"bad_words": [word]})
    assert word not in avoided.text.split(), (word, avoided.text)
    out = cluster.client.generate("The capital of France is", max_tokens=16, temperature=0, ignore_eos=True,
                                  bad_words=[word])
    assert out.text == avoided.text
    assert cluster.wait_pools_free() == {rid: True for rid in cluster.cluster.actors}
