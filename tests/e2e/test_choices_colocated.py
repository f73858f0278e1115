"""n > 1 on a colocated cluster (the real default model) through the
official `openai` client: greedy choices equal, seeded ones reproducible, the
prompt's full blocks computed once and shared, every pool free after."""
from __future__ import annotations

import openai
import pytest

from tests.e2e.conftest import colocated_spec, running_cluster
from tests.e2e.test_openai_surface import assert_forked


@pytest.fixture(scope="module")
def served(ray_instance):
    # no prefix cache: the prompt blocks the choices reuse can only come from the fork
    with running_cluster(colocated_spec(1, colocated={"enable_prefix_caching": False})) as rc:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{rc.http_port}/v1", api_key="unused", max_retries=0,
                               timeout=120)
        yield rc, client, client.models.list().data[0].id


def test_choices_on_a_colocated_replica(served):
    rc, client, model = served
    messages = [{"role": "user", "content": "Write one line about the sea."}]
    greedy = client.chat.completions.create(model=model, messages=messages, n=3, max_tokens=10, temperature=0)
    one = client.chat.completions.create(model=model, messages=messages, max_tokens=10, temperature=0)
    assert [c.message.content for c in greedy.choices] == [one.choices[0].message.content] * 3
    seeded = [[c.message.content for c in client.chat.completions.create(
        model=model, messages=messages, n=3, max_tokens=10, temperature=1.0, seed=9).choices] for _ in range(2)]
    assert seeded[0] == seeded[1] and len(set(seeded[0])) == 3
    streamed = list(client.completions.create(model=model, prompt="The sea is", n=2, max_tokens=6, temperature=0,
                                              stream=True))
    texts = {0: "", 1: ""}
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts[0] == texts[1] and texts[0]
    assert_forked(client, model)
    assert rc.wait_pools_free() == {rid: True for rid in rc.cluster.actors}
