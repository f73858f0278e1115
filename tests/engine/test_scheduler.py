"""The scheduler alone (plain Python, no model): the token budget, chunked
prefill, admission order, and preemption under block pressure, with the
pool back to free at the end of each test."""
from __future__ import annotations

from engine.block_pool import BlockPool
from engine.kv_manager import KVCacheManager
from engine.sampling import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig
from engine.sequence import Sequence, SequenceStatus

BLOCK = 4


def make(num_blocks: int = 64, max_num_seqs: int = 8, budget: int = 16, max_model_len: int = 256,
         prefix_caching: bool = False) -> Scheduler:
    pool = BlockPool(num_blocks, prefix_caching)
    return Scheduler(SchedulerConfig(max_num_seqs, budget, max_model_len), KVCacheManager(pool, BLOCK))


def seq(rid: str, n: int, max_tokens: int = 8, first: int = 0) -> Sequence:
    return Sequence(rid, list(range(first, first + n)), SamplingParams(max_tokens=max_tokens, temperature=0,
                                                                       ignore_eos=True))


def step(sched: Scheduler, token: int = 1):
    """schedule + update, sampling ``token`` for every sequence that samples."""
    out = sched.schedule()
    sched.update(out, {s.seq.request_id: (token, None) for s in out.scheduled if s.samples})
    return out


def plan(out) -> list[tuple[str, int, int]]:
    return [(s.seq.request_id, s.start, s.num_new_tokens) for s in out.scheduled]


def drain(sched: Scheduler, limit: int = 200) -> None:
    for _ in range(limit):
        if not sched.num_unfinished:
            return
        step(sched)
    raise AssertionError("the scheduler did not finish its sequences")


def test_a_long_prompt_is_chunked_to_the_budget_and_samples_only_at_its_end():
    sched = make(budget=16)
    a = seq("a", 40)
    sched.add(a)
    chunks = []
    while not a.output_token_ids:
        out = sched.schedule()
        chunks.append(plan(out))
        assert [s.samples for s in out.scheduled] == [out.scheduled[0].start + out.scheduled[0].num_new_tokens == 40]
        sched.update(out, {"a": (1, None)} if out.scheduled[0].samples else {})
    assert chunks == [[("a", 0, 16)], [("a", 16, 16)], [("a", 32, 8)]]
    assert a.num_computed_tokens == 40 and len(a.block_ids) == 10
    drain(sched)
    assert sched.kv.pool.is_fully_free()


def test_running_sequences_go_first_then_waiting_ones_in_arrival_order_within_the_budget():
    sched = make(budget=12, max_num_seqs=3)
    for rid, n in (("a", 5), ("b", 5), ("c", 5), ("d", 5)):
        sched.add(seq(rid, n))
    # a and b fit whole, c gets the two tokens left; d waits (and max_num_seqs is 3)
    assert plan(step(sched)) == [("a", 0, 5), ("b", 0, 5), ("c", 0, 2)]
    # decodes first (one token each), then c's rest; d waits for a free seat
    assert plan(step(sched)) == [("a", 5, 1), ("b", 5, 1), ("c", 2, 3)]
    assert [s.request_id for s in sched.waiting] == ["d"]
    out = sched.schedule()
    assert sum(s.num_new_tokens for s in out.scheduled) <= 12 and len(sched.running) <= 3
    sched.update(out, {s.seq.request_id: (1, None) for s in out.scheduled if s.samples})
    drain(sched)
    assert sched.kv.pool.is_fully_free()


def test_block_pressure_preempts_the_newest_sequence_and_recomputes_it_later():
    # 6 blocks of 4 tokens: two 8-token prompts take 4; growing both past
    # their blocks needs more than the pool has
    sched = make(num_blocks=6, budget=32)
    a, b = seq("a", 8, max_tokens=12), seq("b", 8, max_tokens=12, first=100)
    sched.add(a)
    sched.add(b)
    preempted_at = None
    for i in range(60):
        out = step(sched)
        if out.preempted and preempted_at is None:
            preempted_at = i
            assert out.preempted == [b]  # the newest goes, the oldest keeps running
            assert b.status is SequenceStatus.WAITING and b.block_ids == [] and b.num_computed_tokens == 0
            assert sched.waiting[0] is b and b.metrics.num_preemptions == 1
            kept = list(b.output_token_ids)
        if not sched.num_unfinished:
            break
    assert preempted_at is not None, "the pool never ran short"
    # nothing dropped: both ran to max_tokens, and b kept the tokens it had before it was preempted
    assert len(a.output_token_ids) == len(b.output_token_ids) == 12
    assert b.output_token_ids[:len(kept)] == kept
    assert a.status is b.status is SequenceStatus.FINISHED_LENGTH
    assert sched.kv.pool.is_fully_free()


def test_a_prompt_that_does_not_fit_waits_instead_of_taking_part_of_the_pool():
    sched = make(num_blocks=4, budget=64)
    big, small = seq("big", 12, max_tokens=8), seq("small", 20, max_tokens=2, first=50)
    sched.add(big)
    sched.add(small)
    assert plan(step(sched)) == [("big", 0, 12)]  # small needs 5 blocks, 1 is left: it holds none meanwhile
    assert small.block_ids == [] and sched.kv.pool.num_free_blocks == 1
    sched.finish(big, SequenceStatus.FINISHED_ABORTED)
    assert sched.kv.pool.is_fully_free()
    sched.finish(small, SequenceStatus.FINISHED_ABORTED)


def test_a_cached_prefix_is_not_computed_again():
    sched = make(budget=64, prefix_caching=True)
    a = seq("a", 13, max_tokens=1)
    sched.add(a)
    drain(sched)
    b = seq("b", 13, max_tokens=1)  # the same 13 tokens: three full blocks are cached
    sched.add(b)
    assert plan(step(sched)) == [("b", 12, 1)] and b.num_prefix_hit_tokens == 12
    assert sched.kv.pool.num_used_blocks == 0
