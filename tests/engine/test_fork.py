"""n > 1: the n choices of a request share one prompt. The first computes it;
the others wait, then fork its full blocks (reference-counted in the pool)
and compute only the last partial block. Scheduler-level (plain Python) and
through engine.LLM on a tiny model; every pool free at the end."""
from __future__ import annotations

import pytest

from engine.sampling import SamplingError, SamplingParams, choice_seed
from engine.sequence import Sequence
from tests.engine.factories import tiny_llm
from tests.engine.test_scheduler import BLOCK, drain, make, plan, step


def _group(n: int, prompt_len: int, max_tokens: int = 4) -> list[Sequence]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, n=n)
    first = None
    out = []
    for j in range(n):
        s = Sequence("r" if j == 0 else f"r#{j}", list(range(prompt_len)), params.for_choice(j), fork_of=first)
        first = first or s
        out.append(s)
    return out


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_forks_share_the_first_choices_full_prompt_blocks_and_compute_only_the_tail(prefix_caching):
    sched = make(budget=64, prefix_caching=prefix_caching)
    lead, b, c = group = _group(3, 10)  # 10 tokens: 2 full blocks of 4, then 2 tokens
    for s in group:
        sched.add(s)
    assert plan(step(sched)) == [("r", 0, 10)]  # the forks wait for the prompt
    assert plan(step(sched)) == [("r", 10, 1), ("r#1", 8, 2), ("r#2", 8, 2)]  # then compute 2 tokens each
    shared = lead.block_ids[:2]
    assert b.block_ids[:2] == c.block_ids[:2] == shared
    assert [sched.kv.pool.ref_counts[x] for x in shared] == [3, 3]
    assert len({lead.block_ids[2], b.block_ids[2], c.block_ids[2]}) == 3  # each writes its own tail block
    assert b.num_prefix_hit_tokens == 8
    drain(sched)
    assert all(len(s.output_token_ids) == 4 for s in group)
    pool = sched.kv.pool
    assert pool.is_fully_free() if not prefix_caching else pool.num_free_blocks == pool.num_blocks


def test_a_waiting_fork_lets_others_pass_and_a_chunked_prompt_is_waited_for():
    sched = make(budget=8)
    lead, b = _group(2, 14)
    other = Sequence("o", [7, 7, 7], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    for s in (lead, b, other):
        sched.add(s)
    assert plan(step(sched)) == [("r", 0, 8)]  # budget spent on the first chunk
    assert plan(step(sched)) == [("r", 8, 6), ("o", 0, 2)]  # the fork waits, the other request passes it
    out = step(sched)
    assert ("r#1", 12, 2) in plan(out)  # 3 full blocks shared, the last 2 tokens its own
    drain(sched)
    assert sched.kv.pool.is_fully_free()


def test_a_prefill_only_first_choice_still_holding_its_blocks_is_shared():
    """On a prefill replica the first choice finishes at its first token but keeps its blocks while they are
    sent: a fork admitted then still shares them."""
    sched = make(budget=64)
    lead, b = _group(2, 10)
    lead.prefill_only = b.prefill_only = True
    sched.add(lead)
    sched.add(b)
    assert plan(step(sched)) == [("r", 0, 10)] and lead.is_finished and lead.block_ids
    assert plan(step(sched)) == [("r#1", 8, 2)] and b.block_ids[:2] == lead.block_ids[:2]
    for s in (lead, b):
        sched.kv.free(s)  # what the prefill stage does once each transfer is done
    assert sched.kv.pool.is_fully_free()


def test_a_fork_whose_first_choice_is_gone_computes_the_prompt_itself():
    sched = make(budget=64)
    lead, b = _group(2, 10)
    sched.add(lead)
    sched.add(b)
    step(sched)
    sched.finish(lead, lead.status.FINISHED_ABORTED)
    assert plan(step(sched)) == [("r#1", 0, 10)]
    drain(sched)
    assert sched.kv.pool.is_fully_free()


def test_choice_parameters():
    p = SamplingParams(seed=7, n=3, stop=["x"])
    assert [p.for_choice(j).seed for j in range(3)] == [7, choice_seed(7, 1), choice_seed(7, 2)]
    assert len({choice_seed(7, j) for j in range(3)}) == 3 and p.for_choice(2).n == 1
    assert SamplingParams(n=3).for_choice(1).seed is None
    for bad in (0, 17, 1.5):
        with pytest.raises(SamplingError, match="^n:"):
            SamplingParams(n=bad)


# ---- through engine.LLM ----------------------------------------------------------

@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return tiny_llm(tmp_path_factory.mktemp("tiny"), llm_kw={"block_size": BLOCK * 4})


PROMPT = list(range(3, 40))  # 37 tokens: 2 full blocks of 16 and 5 more


def test_greedy_choices_are_equal_and_equal_to_one_choice(llm):
    one = llm.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    outs = llm.generate([PROMPT, [5, 6, 7]], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, n=3))
    assert [o.request_id.partition("#")[2] for o in outs] == ["", "1", "2"] * 2
    assert [o.token_ids for o in outs[:3]] == [one.token_ids] * 3
    assert [o.num_cached_tokens for o in outs[:3]][1:] == [32, 32]  # the forks reused 2 blocks of the prompt
    assert llm.core.is_idle()


def test_seeded_choices_are_reproducible_and_differ(llm):
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=123, ignore_eos=True, n=3)
    first = [o.token_ids for o in llm.generate([PROMPT], params)]
    again = [o.token_ids for o in llm.generate([PROMPT], params)]
    assert first == again and len({tuple(t) for t in first}) == 3
    alone = llm.generate([PROMPT], SamplingParams(max_tokens=12, temperature=1.0, seed=123, ignore_eos=True))[0]
    assert first[0] == alone.token_ids  # choice 0 is what n=1 gives
    j2 = llm.generate([PROMPT], SamplingParams(max_tokens=12, temperature=1.0, seed=choice_seed(123, 2),
                                               ignore_eos=True))[0]
    assert first[2] == j2.token_ids  # choice j: the stream of (seed, j, position), whether forked or not
    assert llm.core.is_idle()
