"""A deployment whose prompt-computing replicas run several ranks cannot score a prompt
(`EngineCore.add` refuses it there): the frontends refuse such a request at once, 400 /
INVALID_ARGUMENT naming the field and the stage, before any replica sees it."""
from __future__ import annotations

import grpc
import openai
import pytest

from cluster.client import KVRelayClient, KVRelayError
from cluster.launcher import prompt_logprobs_refusal
from cluster.spec import Spec, split_spec
from tests.cluster.test_http import ServedFrontends
from tests.cluster.conftest import EchoBackend, ServedFrontend

REFUSAL = "not served by this deployment: its prefill replicas run 2 ranks each"


def test_which_deployments_score_prompts():
    def refusal(spec: dict) -> str | None:
        return prompt_logprobs_refusal(split_spec(Spec.model_validate(spec)))

    assert refusal({}) is None  # the default: one prefill and one decode replica of one rank
    assert refusal({"prefill": {"tensor_parallel_size": 2, "tp_backend": "gloo"}}).startswith(
        REFUSAL + " (tensor_parallel_size 2 x pipeline_parallel_size 1)")
    # the decode stage computes no prompt: its layout does not matter
    assert refusal({"decode": {"tensor_parallel_size": 2, "tp_backend": "gloo"}}) is None
    assert "its colocated replicas run 2 ranks each (tensor_parallel_size 1 x pipeline_parallel_size 2)" in refusal(
        {"mode": "colocated", "colocated": {"pipeline_parallel_size": 2}})


@pytest.fixture(scope="module")
def backend():
    b = EchoBackend()
    b.prompt_logprobs_refusal = REFUSAL + " (tensor_parallel_size 2 x pipeline_parallel_size 1)"
    return b


def test_http_refuses_by_name(backend):
    server = ServedFrontends(backend)
    try:
        client = server.client()
        for kwargs, field in ((dict(echo=True, logprobs=1), "echo"), (dict(extra_body={"prompt_logprobs": 0}),
                                                                      "prompt_logprobs")):
            with pytest.raises(openai.BadRequestError) as info:
                client.completions.create(model="echo", prompt="hello world", max_tokens=1, **kwargs)
            assert info.value.param == field and info.value.body["message"].startswith(f"{field}: {REFUSAL}")
        assert not backend.requests  # refused before the backend
        assert client.completions.create(model="echo", prompt="hello world", max_tokens=1, echo=True).choices
        assert [r.sampling.prompt_logprobs for r in backend.requests] == [None]  # echo alone is served
    finally:
        server.close()


def test_grpc_refuses_by_name(backend):
    server = ServedFrontend(backend)
    try:
        with KVRelayClient(server.target) as client, pytest.raises(KVRelayError) as e:
            client.generate("hello world", max_tokens=1, prompt_logprobs=0)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.message.startswith(f"prompt_logprobs: {REFUSAL}")
    finally:
        server.close()
