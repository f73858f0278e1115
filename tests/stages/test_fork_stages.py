"""n > 1 across the seam with one transfer: choice 0 is prefilled on the
prefill replica and its KV sent once; choices j > 0 are `Submit`s with
``fork_of`` on the decode replica, which fork there from choice 0's prompt
once it is admitted (the full blocks shared, the last partial block and the
first token their own). Their tokens equal the offline engine's n choices,
greedy and seeded; the prefill replica computed the prompt once and sent its
blocks once; a fork whose sibling's KV never comes computes the prompt on the
decode replica; every pool is free after."""
from __future__ import annotations

import pytest

from engine.sampling import SamplingParams
from engine.serving.frames import Abort, Attach, FirstToken, Prefill, PrefillDone, Reserve, Submit, TicketReady
from engine.serving.types import FinishReason
from tests.engine.factories import random_prompts
from tests.stages.harness import Driver, wait_free
from tests.stages.test_stages import model_dir, reference, stages  # noqa: F401  (the tiny model's stages)

BLOCK = 16


def _forked(prefill: Driver, decode: Driver, rid: str, prompt: list[int], params: SamplingParams,
            transfer: bool = True) -> list[list[int]]:
    """The n choices as the frontend runs them on one (prefill, decode) pair: each choice's tokens."""
    ids = [rid] + [f"{rid}-{j}" for j in range(1, params.n)]
    decode.send(Reserve(rid, prompt, params.for_choice(0)))
    for j, cid in enumerate(ids[1:], 1):
        decode.send(Submit(cid, prompt, params.for_choice(j), fork_of=rid))
    ticket = decode.next(rid)
    assert isinstance(ticket, TicketReady), ticket
    if not transfer:  # the sibling goes before its KV came
        decode.send(Abort(rid))
        assert decode.next(rid).finish_reason is FinishReason.ABORT
        return [[t for d in decode.stream(cid) for t in d.token_ids] for cid in ids[1:]]
    prefill.send(Prefill(rid, prompt, params.for_choice(0)))
    prefill.send(Attach(rid, ticket.ticket))
    first = prefill.next(rid)
    assert isinstance(first, FirstToken), first
    done = prefill.next(rid)
    assert isinstance(done, PrefillDone) and done.ok, done
    out = [first.delta.token_ids + [t for d in decode.stream(rid) for t in d.token_ids]]
    return out + [[t for d in decode.stream(cid) for t in d.token_ids] for cid in ids[1:]]


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, n=3),
                                    SamplingParams(max_tokens=10, temperature=1.0, seed=11, ignore_eos=True, n=3)],
                         ids=["greedy", "seeded"])
def test_choices_fork_on_the_decode_replica_from_one_transfer(reference, stages, params):
    prefill, decode = stages
    (prompt,) = random_prompts(1, 96, [2 * BLOCK + 5], seed=7)  # 2 full blocks shared, 5 tokens each fork's own
    computed = prefill.stage.core.num_prompt_tokens_computed, decode.stage.core.num_prompt_tokens_computed
    sent = prefill.stage.num_kv_bytes_sent
    got = _forked(prefill, decode, "r", prompt, params)
    assert got == [o.token_ids for o in reference.generate([prompt], params)]
    if params.is_greedy:
        assert len({tuple(t) for t in got}) == 1
    else:
        assert len({tuple(t) for t in got}) == 3
    # the prompt computed once, on the prefill replica; each fork computed only its 5-token tail
    assert prefill.stage.core.num_prompt_tokens_computed - computed[0] == len(prompt)
    assert decode.stage.core.num_prompt_tokens_computed - computed[1] == 2 * 5
    # its blocks sent once
    assert prefill.stage.num_kv_bytes_sent - sent == 3 * prefill.stage.core.kv_spec.bytes_per_block
    assert wait_free(prefill.stage, decode.stage)


def test_forks_whose_sibling_never_gets_its_kv_compute_the_prompt_on_the_decode_replica(reference, stages):
    prefill, decode = stages
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, n=3)
    (prompt,) = random_prompts(1, 96, [40], seed=8)
    before = decode.stage.core.num_prompt_tokens_computed
    got = _forked(prefill, decode, "r", prompt, params, transfer=False)
    assert got == [reference.generate([prompt], params)[0].token_ids] * 2
    assert len(prompt) <= decode.stage.core.num_prompt_tokens_computed - before < 2 * len(prompt)  # once, forked
    assert wait_free(prefill.stage, decode.stage)


def test_a_fork_aborted_while_its_sibling_waits_for_the_kv_leaves_the_sibling_whole(reference, stages):
    prefill, decode = stages
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, n=2)
    (prompt,) = random_prompts(1, 96, [21], seed=9)
    decode.send(Reserve("r", prompt, params.for_choice(0)))
    decode.send(Submit("r-1", prompt, params.for_choice(1), fork_of="r"))
    ticket = decode.next("r")
    decode.send(Abort("r-1"))
    assert decode.next("r-1").finish_reason is FinishReason.ABORT
    prefill.send(Prefill("r", prompt, params.for_choice(0)))
    prefill.send(Attach("r", ticket.ticket))
    first = prefill.next("r")
    assert prefill.next("r").ok
    got = first.delta.token_ids + [t for d in decode.stream("r") for t in d.token_ids]
    assert got == reference.generate([prompt], params.for_choice(0))[0].token_ids
    assert wait_free(prefill.stage, decode.stage)
    assert decode.stage.load().num_running_seqs == 0 and decode.stage.load().num_waiting_seqs == 0
