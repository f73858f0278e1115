"""Structured output over gRPC, and a guided request that migrates: its
decode replica's channel breaks mid-stream, the request resumes on the other
decode replica with the tokens streamed so far, the grammar is rebuilt from
them there, and the client gets the same tokens as an unfaulted run, valid
for the schema."""
from __future__ import annotations

import json
import time

import grpc
import jsonschema
import pytest

from cluster.client import KVRelayError
from tests.e2e.conftest import disagg_spec, running_cluster

NUMBERS = {"type": "array", "minItems": 20, "maxItems": 20, "items": {"type": "integer", "minimum": 100,
                                                                       "maximum": 999}}
PROMPT = "Write twenty numbers as a JSON array."


@pytest.fixture(scope="module")
def cluster(ray_instance):
    with running_cluster(disagg_spec(1, 2, "grpc", router={"policy": "least_loaded"})) as rc:
        yield rc
        assert rc.wait_pools_free() == {rid: True for rid in rc.cluster.actors}


def test_grpc_guided_json_and_choice(cluster):
    out = cluster.client.generate(PROMPT, max_tokens=160, temperature=0.7, seed=5,
                                  guided={"json_schema": NUMBERS})
    jsonschema.validate(json.loads(out.text), NUMBERS)
    out = cluster.client.chat([{"role": "user", "content": "Red or blue?"}], max_tokens=8, temperature=0,
                              guided={"choice": ["red", "blue"]})
    assert out.text in ("red", "blue") and out.finish_reason.value == "stop"


@pytest.mark.parametrize("guided, field", [({"json_schema": {"type": "nonsense"}}, "guided.json_schema"),
                                           ({"regex": "(a"}, "guided.regex"),
                                           ({"choice": []}, "guided.choice")])
def test_grpc_bad_constraint_is_invalid_argument_naming_it(cluster, guided, field):
    with pytest.raises(KVRelayError) as e:
        cluster.client.generate("Hi", max_tokens=4, guided=guided)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and e.value.message.startswith(field), e.value.message


def test_a_guided_request_migrates_and_its_grammar_is_rebuilt(cluster):
    kwargs = dict(max_tokens=160, temperature=0, guided={"json_schema": NUMBERS})
    want = cluster.client.generate(PROMPT, **kwargs)
    jsonschema.validate(json.loads(want.text), NUMBERS)
    stream = cluster.client.stream(PROMPT, **kwargs)
    got = list(next(stream).token_ids)
    deadline = time.monotonic() + 30
    while not (busy := [r.replica_id for r in cluster.client.status().replicas
                        if r.replica_id.startswith("decode") and r.num_running_seqs > 0]):
        assert time.monotonic() < deadline, "no decode replica took the request"
        time.sleep(0.02)

    async def break_channel():
        cluster.cluster.backend.channels.drop(busy[0])
    cluster.run(break_channel())
    chunks = list(stream)
    got += [t for c in chunks for t in c.token_ids]
    assert got == list(want.token_ids) and chunks[-1].finish_reason.value == "stop"
    text = "".join(c.text for c in chunks)
    assert text and want.text.endswith(text)
