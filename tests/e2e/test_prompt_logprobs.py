"""The prompt's logprobs through a served cluster (the real default model), as the ecosystem asks for
them: lm-evaluation-harness scores a continuation with a completion of token-id prompts, ``echo``,
``logprobs`` 1 and ``max_tokens`` 1, and reads ``token_logprobs`` and ``top_logprobs`` of the prompt's
tokens; vLLM's ``prompt_logprobs`` extension gives them per choice (chat: beside the choices). Each
equals engine.LLM's on the same weights, disaggregated (the prefill replica scores the prompt, its
prefix cache on) and colocated; every pool is free afterwards."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import grpc
import pytest

from cluster.client import KVRelayError
from engine.llm import LLM
from engine.sampling import SamplingParams
from tests.e2e.conftest import colocated_spec, disagg_spec, running_cluster

CONTEXT = "Question: What is the capital of France?\nAnswer:"
CONTINUATIONS = [" Paris", " London is the capital of England"]
TOP = 2


@pytest.fixture(scope="module")
def reference(default_model_dir):
    llm = LLM(str(default_model_dir), dtype="float32", num_kv_blocks=256)
    tok = llm.tokenizer
    ctx = tok.encode(CONTEXT, add_special_tokens=False)
    prompts = [ctx + tok.encode(c, add_special_tokens=False) for c in CONTINUATIONS]
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=TOP))
    return len(ctx), prompts, [o.prompt_logprobs for o in outs], lambda t: tok.decode([t])


def post(port: int, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def loglikelihood(choice: dict, ctxlen: int) -> tuple[float, bool]:
    """lm-evaluation-harness's reading of an echoed completion (its local-completions model)."""
    lps = choice["logprobs"]
    token_logprobs, top = lps["token_logprobs"][ctxlen:-1], lps["top_logprobs"][ctxlen:-1]
    return sum(token_logprobs), all(t == max(alt.values()) for t, alt in zip(token_logprobs, top))


def check_echo(choice: dict, prompt: list[int], ref: list, text_of) -> None:
    lps = choice["logprobs"]
    assert len(lps["tokens"]) == len(prompt) + 1  # the prompt, then the one token generated
    assert lps["tokens"][:len(prompt)] == [text_of(t) for t in prompt]
    assert lps["token_logprobs"][0] is None and lps["top_logprobs"][0] is None
    for got, want, top, tok in zip(lps["token_logprobs"][1:len(prompt)], ref[1:], lps["top_logprobs"][1:],
                                   prompt[1:]):
        assert got == pytest.approx(want["token_logprob"], abs=1e-3)
        best = max(top, key=top.get)
        assert best == text_of(want["top"][0][0]) or top[best] == pytest.approx(want["top"][0][1], abs=1e-3)
    assert lps["text_offset"][:2] == [0, len(text_of(prompt[0]))]
    assert choice["text"].startswith(CONTEXT)


@pytest.fixture(scope="module", params=[pytest.param("disagg", id="disagg-grpc"),
                                        pytest.param("colocated", id="colocated")])
def cluster(request, ray_instance):
    spec = disagg_spec(1, 1, "grpc") if request.param == "disagg" else colocated_spec(1)
    with running_cluster(spec) as rc:
        yield rc


def test_lm_eval_loglikelihood_requests(cluster, reference):
    """Token-id prompts in one request, as lm-eval batches them (24 of them: more than n's bound of 16);
    asked twice, the second time out of the prefill replica's prefix cache, which must not skip the
    positions being scored."""
    ctxlen, prompts, refs, text_of = reference
    prompts, refs = prompts * 12, refs * 12
    body = {"model": "SmolLM2-135M-Instruct", "prompt": prompts, "max_tokens": 1, "logprobs": 1, "echo": True,
            "temperature": 0, "seed": 1234}
    for _ in range(2):
        status, r = post(cluster.http_port, "completions", body)
        assert status == 200, r
        choices = sorted(r["choices"], key=lambda c: c["index"])
        assert len(choices) == len(prompts)
        for choice, prompt, ref in zip(choices, prompts, refs):
            check_echo(choice, prompt, ref, text_of)
            want = sum(lp["token_logprob"] for lp in ref[ctxlen:])
            got, greedy = loglikelihood(choice, ctxlen)
            assert got == pytest.approx(want, abs=5e-3)
            assert greedy == all(lp["rank"] == 1 for lp in ref[ctxlen:])
    assert cluster.wait_pools_free() == {rid: True for rid in cluster.cluster.actors}


def test_vllm_prompt_logprobs_and_a_streamed_echo(cluster, reference):
    ctxlen, prompts, refs, text_of = reference
    status, r = post(cluster.http_port, "completions", {"prompt": prompts[0], "max_tokens": 2, "n": 2,
                                                        "temperature": 0, "prompt_logprobs": TOP})
    assert status == 200, r
    for choice in r["choices"]:  # choice 1 forks choice 0's prompt and gets its scores
        field = choice["prompt_logprobs"]
        assert field[0] is None and len(field) == len(prompts[0])
        for entry, tok, ref in zip(field[1:], prompts[0][1:], refs[0][1:]):
            assert entry[str(tok)]["rank"] == ref["rank"]
            assert entry[str(tok)]["logprob"] == pytest.approx(ref["token_logprob"], abs=1e-3)
            assert entry[str(tok)]["decoded_token"] == text_of(tok)
            assert len(entry) in (TOP, TOP + 1)  # the top alternatives, and the prompt's token if not one
    request = urllib.request.Request(
        f"http://127.0.0.1:{cluster.http_port}/v1/completions", headers={"Content-Type": "application/json"},
        data=json.dumps({"prompt": prompts[1], "max_tokens": 3, "echo": True, "logprobs": 0, "stream": True,
                         "temperature": 0}).encode())
    with urllib.request.urlopen(request, timeout=120) as resp:
        events = [json.loads(line[6:]) for line in resp.read().decode().splitlines()
                  if line.startswith("data: {")]
    first = events[0]["choices"][0]["logprobs"]
    assert first["token_logprobs"][0] is None
    assert first["token_logprobs"][1:len(prompts[1])] == pytest.approx([lp["token_logprob"] for lp in refs[1][1:]],
                                                                       abs=1e-3)
    assert sum(len(e["choices"][0]["logprobs"]["tokens"]) for e in events) == len(prompts[1]) + 3
    assert cluster.wait_pools_free() == {rid: True for rid in cluster.cluster.actors}


def test_grpc_prompt_logprobs(cluster, reference):
    _, prompts, refs, _ = reference
    out = cluster.client.generate(token_ids=prompts[0], max_tokens=1, temperature=0, prompt_logprobs=TOP)
    assert [lp.token_id for lp in out.prompt_logprobs] == prompts[0][1:]
    assert [lp.rank for lp in out.prompt_logprobs] == [ref["rank"] for ref in refs[0][1:]]
    for lp, ref in zip(out.prompt_logprobs, refs[0][1:]):
        assert lp.logprob == pytest.approx(ref["token_logprob"], abs=1e-3)
        assert [t for t, _ in lp.top] == [t for t, _ in ref["top"]]
    with pytest.raises(KVRelayError) as e:
        cluster.client.generate("Hi", max_tokens=1, prompt_logprobs=-1)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and e.value.message.startswith("prompt_logprobs")
    assert cluster.wait_pools_free() == {rid: True for rid in cluster.cluster.actors}


def test_chat_prompt_logprobs_and_bad_values(cluster):
    status, r = post(cluster.http_port, "chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                             "max_tokens": 1, "prompt_logprobs": 0})
    assert status == 200, r
    assert r["prompt_logprobs"][0] is None and len(r["prompt_logprobs"]) == r["usage"]["prompt_tokens"]
    assert all(len(e) == 1 for e in r["prompt_logprobs"][1:])
    status, r = post(cluster.http_port, "completions", {"prompt": "Hi", "prompt_logprobs": 21})
    assert status == 400 and r["error"]["param"] == "prompt_logprobs", r
    status, r = post(cluster.http_port, "completions", {"prompt": "Hi", "echo": True, "logprobs": 50})
    assert status == 400 and r["error"]["param"] == "logprobs", r
    assert cluster.wait_pools_free() == {rid: True for rid in cluster.cluster.actors}


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_max_tokens_0_scores_the_prompt_alone(cluster, reference, stream):
    """OpenAI's legacy way to score a prompt (older lm-evaluation-harness and HELM clients): ``echo``,
    ``logprobs`` and ``max_tokens`` 0 give the prompt, its tokens' logprobs, no completion token and
    finish reason "length"; without echo, max_tokens 0 is refused by name."""
    ctxlen, prompts, refs, text_of = reference
    body = {"prompt": prompts[1], "max_tokens": 0, "echo": True, "logprobs": 1, "stream": stream,
            "stream_options": {"include_usage": True} if stream else None}
    if not stream:
        status, r = post(cluster.http_port, "completions", body)
        assert status == 200, r
        choice, usage = r["choices"][0], r["usage"]
    else:
        request = urllib.request.Request(f"http://127.0.0.1:{cluster.http_port}/v1/completions",
                                         headers={"Content-Type": "application/json"}, data=json.dumps(body).encode())
        with urllib.request.urlopen(request, timeout=120) as resp:
            events = [json.loads(line[6:]) for line in resp.read().decode().splitlines() if line.startswith("data: {")]
        chunks = [e["choices"][0] for e in events if e["choices"]]
        lps = {k: [v for c in chunks if c["logprobs"] for v in c["logprobs"][k]]
               for k in ("tokens", "token_logprobs", "top_logprobs")}
        choice = {"text": "".join(c["text"] for c in chunks), "logprobs": lps,
                  "finish_reason": chunks[-1]["finish_reason"]}
        usage = events[-1]["usage"]
    assert choice["text"] == CONTEXT + CONTINUATIONS[1]  # the prompt (token ids, decoded), nothing after
    assert choice["finish_reason"] == "length"
    lps = choice["logprobs"]
    assert lps["tokens"] == [text_of(t) for t in prompts[1]]  # the prompt's, and nothing after
    assert lps["token_logprobs"][0] is None
    assert lps["token_logprobs"][1:] == pytest.approx([lp["token_logprob"] for lp in refs[1][1:]], abs=1e-3)
    assert usage["completion_tokens"] == 0 and usage["prompt_tokens"] == len(prompts[1])
    status, r = post(cluster.http_port, "completions", {"prompt": "Hi", "max_tokens": 0})
    assert status == 400 and r["error"]["param"] == "max_tokens", r
    assert cluster.wait_pools_free() == {rid: True for rid in cluster.cluster.actors}
