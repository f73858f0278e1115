import asyncio
import itertools

import pytest
from hypothesis import given, settings, strategies as st

from cluster.router import Placement, ReplicaLoad, Router, RouterConfig
from cluster.types import GenerateRequest, NoReplicaError, OverloadedError, Stage

_ids = itertools.count()


def req(tokens=None, n=32) -> GenerateRequest:
    return GenerateRequest(f"r{next(_ids)}", list(tokens) if tokens is not None else list(range(n)))


def make_router(num_prefill=2, num_decode=2, *, mode="disaggregated", **kw) -> Router:
    router = Router(RouterConfig(mode=mode, **kw))
    if mode == "colocated":
        for i in range(num_prefill):
            router.add_replica(f"c{i}", Stage.COLOCATED)
    else:
        for i in range(num_prefill):
            router.add_replica(f"p{i}", Stage.PREFILL)
        for i in range(num_decode):
            router.add_replica(f"d{i}", Stage.DECODE)
    return router


def report(router, rid, stage, t=1.0, **kw):
    router.report_load(ReplicaLoad(rid, stage, timestamp=t, **kw))


def assert_no_leaks(router: Router):
    assert router.num_active == 0 and router.num_waiting == 0
    assert all(r.num_in_flight == 0 for r in router.replicas())


def test_least_loaded_sends_work_to_the_idle_replica():
    router = make_router(policy="least_loaded")
    report(router, "p0", Stage.PREFILL, num_queued_prefill_tokens=5000)
    report(router, "p1", Stage.PREFILL, num_queued_prefill_tokens=0)
    report(router, "d0", Stage.DECODE, num_free_blocks=10, num_total_blocks=100, num_running_seqs=50)
    report(router, "d1", Stage.DECODE, num_free_blocks=90, num_total_blocks=100, num_running_seqs=3)
    p = router.try_place(req())
    assert (p.prefill_replica, p.decode_replica) == ("p1", "d1")
    statuses = {s.replica_id: s for s in router.replica_statuses()}
    assert statuses["d1"].num_in_flight == 1 and statuses["d1"].kv_usage == pytest.approx(0.1)
    router.release(p)
    assert_no_leaks(router)


def test_decode_ties_on_free_blocks_break_on_running_seqs():
    router = make_router(1, 2, policy="least_loaded")
    report(router, "d0", Stage.DECODE, num_free_blocks=50, num_running_seqs=9)
    report(router, "d1", Stage.DECODE, num_free_blocks=50, num_running_seqs=2)
    assert router.try_place(req(n=1)).decode_replica == "d1"


def test_a_burst_between_reports_spreads_out():
    router = make_router(policy="least_loaded")
    for rid in ("d0", "d1"):
        report(router, rid, Stage.DECODE, num_free_blocks=100, num_total_blocks=100)
    placements = [router.try_place(req(n=64)) for _ in range(10)]
    prefill = [p.prefill_replica for p in placements]
    decode = [p.decode_replica for p in placements]
    assert prefill.count("p0") == prefill.count("p1") == 5
    assert decode.count("d0") == decode.count("d1") == 5
    # A report replaces the optimistic adjustments made before it.
    report(router, "p0", Stage.PREFILL, t=2.0, num_queued_prefill_tokens=0)
    report(router, "p1", Stage.PREFILL, t=2.0, num_queued_prefill_tokens=10_000)
    extra = router.try_place(req())
    assert extra.prefill_replica == "p0"
    for p in placements + [extra]:
        router.release(p)
    assert_no_leaks(router)


def test_out_of_order_reports_are_ignored():
    router = make_router(policy="least_loaded")
    report(router, "p0", Stage.PREFILL, t=5.0, num_queued_prefill_tokens=0)
    report(router, "p1", Stage.PREFILL, t=5.0, num_queued_prefill_tokens=100)
    report(router, "p0", Stage.PREFILL, t=4.0, num_queued_prefill_tokens=10_000)  # stale
    assert router.try_place(req()).prefill_replica == "p0"


def test_round_robin_cycles():
    router = make_router(3, 1, policy="round_robin")
    got = [router.try_place(req()).prefill_replica for _ in range(6)]
    assert got == ["p0", "p1", "p2", "p0", "p1", "p2"]


def test_prefix_aware_follows_the_cache_unless_the_replica_is_swamped():
    block = 16
    router = make_router(3, 1, policy="prefix_aware", block_size=block)
    system_prompt = list(range(1000, 1000 + 8 * block))  # 8 full blocks
    from engine.block_pool import compute_block_hashes
    cached = frozenset(compute_block_hashes(system_prompt, block))
    report(router, "p0", Stage.PREFILL, num_queued_prefill_tokens=40)
    report(router, "p1", Stage.PREFILL, num_queued_prefill_tokens=40, cached_block_hashes=cached)
    report(router, "p2", Stage.PREFILL, num_queued_prefill_tokens=0)
    p = router.try_place(req(system_prompt + [1, 2, 3]))
    assert p.prefill_replica == "p1"
    router.release(p)
    # Swamped: its queue outweighs the 128 cached tokens, so the idle replica wins.
    report(router, "p1", Stage.PREFILL, t=2.0, num_queued_prefill_tokens=5000, cached_block_hashes=cached)
    assert router.try_place(req(system_prompt + [1, 2, 3])).prefill_replica == "p2"


def test_prefix_aware_keeps_a_new_prefix_together_within_a_burst():
    router = make_router(3, 1, policy="prefix_aware", block_size=16)
    shared = list(range(500, 500 + 256))  # 16 blocks
    first = router.try_place(req(shared + [1]))
    again = [router.try_place(req(shared + [i])) for i in range(2, 4)]
    assert all(p.prefill_replica == first.prefill_replica for p in again)
    other = router.try_place(req(list(range(9000, 9000 + 256))))
    assert other.prefill_replica != first.prefill_replica


@settings(max_examples=60, deadline=None)
@given(loads=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 100), st.integers(0, 64)),
                      min_size=2, max_size=8),
       seed=st.integers(0, 2**16))
def test_power_of_two_never_picks_the_worse_of_its_two(loads, seed):
    router = Router(RouterConfig(policy="power_of_two", seed=seed, mode="colocated"))
    for i, (queued, free, running) in enumerate(loads):
        router.add_replica(f"c{i}", Stage.COLOCATED)
        report(router, f"c{i}", Stage.COLOCATED, num_queued_prefill_tokens=queued,
               num_free_blocks=free, num_running_seqs=running)
    from cluster.router import load_key
    replicas = router.replicas()
    rng_probe = __import__("random").Random(seed)
    for _ in range(5):
        a, b = rng_probe.sample(replicas, 2)  # the same draws the policy makes
        expected = a if load_key(a) <= load_key(b) else b
        picked = router.policy.choose(replicas, None)
        assert picked is expected
        assert load_key(picked) <= max(load_key(a), load_key(b))


def test_dead_replicas_are_skipped_and_can_come_back():
    router = make_router(policy="round_robin")
    router.mark_dead("p0")
    router.mark_dead("d1")
    got = [router.try_place(req()) for _ in range(4)]
    assert {p.prefill_replica for p in got} == {"p1"} and {p.decode_replica for p in got} == {"d0"}
    router.mark_dead("p1")
    with pytest.raises(NoReplicaError, match="no live prefill replica"):
        router.try_place(req())
    router.mark_alive("p0")
    assert router.try_place(req()).prefill_replica == "p0"


def test_colocated_placement_uses_one_replica():
    router = make_router(2, mode="colocated", policy="least_loaded")
    report(router, "c0", Stage.COLOCATED, num_queued_prefill_tokens=900)
    p = router.try_place(req())
    assert p.prefill_replica is None and p.decode_replica == "c1" and p.replica_ids == ("c1",)
    router.release(p)
    assert_no_leaks(router)


def test_double_release_is_an_error():
    router = make_router()
    p = router.try_place(req())
    router.release(p)
    with pytest.raises(ValueError, match="already released"):
        router.release(p)


def test_queue_waits_for_capacity_then_admits_in_order():
    async def main():
        router = make_router(1, 1, max_inflight_per_replica=2, max_queue=4, queue_timeout_s=5)
        held = [await router.acquire(req()) for _ in range(2)]
        waiting = [asyncio.create_task(router.acquire(req())) for _ in range(3)]
        await asyncio.sleep(0)
        assert router.num_waiting == 3 and not any(t.done() for t in waiting)
        router.release(held.pop(0))
        await asyncio.sleep(0)
        assert waiting[0].done() and not waiting[1].done()
        router.release(held.pop(0))
        router.release(await waiting[0])
        for t in waiting[1:]:
            router.release(await t)
        assert_no_leaks(router)
    asyncio.run(main())


def test_queue_bound_and_timeout_refuse_with_overloaded():
    async def main():
        router = make_router(1, 1, max_inflight_per_replica=1, max_queue=2, queue_timeout_s=0.05)
        held = await router.acquire(req())
        waiting = [asyncio.create_task(router.acquire(req())) for _ in range(2)]
        await asyncio.sleep(0)
        with pytest.raises(OverloadedError, match="max_queue=2"):
            await router.acquire(req())
        for t in waiting:
            with pytest.raises(OverloadedError, match="within 0.05s"):
                await t
        router.release(held)
        assert_no_leaks(router)
    asyncio.run(main())


def test_max_queue_zero_refuses_at_once():
    async def main():
        router = make_router(1, 1, max_inflight_per_replica=1, max_queue=0)
        held = await router.acquire(req())
        with pytest.raises(OverloadedError):
            await router.acquire(req())
        router.release(held)
        assert_no_leaks(router)
    asyncio.run(main())


def test_a_cancelled_waiter_leaves_nothing_behind():
    async def main():
        router = make_router(1, 1, max_inflight_per_replica=1, queue_timeout_s=5)
        held = await router.acquire(req())
        waiter = asyncio.create_task(router.acquire(req()))
        await asyncio.sleep(0)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        router.release(held)
        assert_no_leaks(router)
        # Granted and cancelled in the same tick: the grant is handed back.
        held = await router.acquire(req())
        waiter = asyncio.create_task(router.acquire(req()))
        await asyncio.sleep(0)
        router.release(held)  # grants the waiter
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert_no_leaks(router)
    asyncio.run(main())


@settings(max_examples=25, deadline=None)
@given(ops=st.lists(st.tuples(st.integers(1, 200), st.floats(0, 0.003), st.booleans()), min_size=1, max_size=30),
       policy=st.sampled_from(["round_robin", "least_loaded", "power_of_two", "prefix_aware"]))
def test_every_acquire_is_released(ops, policy):
    """Any mix of finishing, cancelled and refused requests leaves the router empty."""
    async def one(router, n, hold, cancel):
        task = asyncio.create_task(router.acquire(req(n=n)))
        if cancel:
            await asyncio.sleep(hold)
            task.cancel()
        try:
            placement: Placement = await task
        except (OverloadedError, asyncio.CancelledError):
            return
        try:
            await asyncio.sleep(hold)
        finally:
            router.release(placement)

    async def main():
        router = make_router(2, 2, policy=policy, max_inflight_per_replica=2, max_queue=5, queue_timeout_s=0.01)
        await asyncio.gather(*(one(router, n, hold, cancel) for n, hold, cancel in ops))
        assert_no_leaks(router)
    asyncio.run(main())


def test_waiters_fail_fast_when_a_stage_loses_its_last_replica():
    async def main():
        router = make_router(1, 2, max_inflight_per_replica=1, queue_timeout_s=5)
        held = [await router.acquire(req())]
        waiting = [asyncio.create_task(router.acquire(req())) for _ in range(2)]
        await asyncio.sleep(0)
        router.mark_dead("d1")  # decode still has d0: keep waiting
        await asyncio.sleep(0)
        assert not any(t.done() for t in waiting)
        router.mark_dead("p0")  # no prefill replica left
        for t in waiting:
            with pytest.raises(NoReplicaError, match="no live prefill replica"):
                await t
        router.release(held.pop())
        assert_no_leaks(router)
    asyncio.run(main())


def test_requests_wait_for_a_stages_last_replica_while_it_is_replaced():
    """A stage's only replica down but coming back (being replaced): new requests, and those migrating off
    it, wait in the admission queue and are placed on it once it serves; given up on, they fail at once."""
    async def main():
        router = make_router(1, 1, queue_timeout_s=5)
        router.mark_dead("d0", returning=True)
        waiting = [asyncio.create_task(router.acquire(req())) for _ in range(2)]
        await asyncio.sleep(0.05)
        assert not any(t.done() for t in waiting) and router.num_waiting == 2
        router.mark_alive("d0")
        placed = [await t for t in waiting]
        assert {p.decode_replica for p in placed} == {"d0"}
        for p in placed:
            router.release(p)
        router.mark_dead("p0", returning=True)
        waiting = asyncio.create_task(router.acquire(req()))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        router.mark_dead("p0")  # its replacements failed: not coming back
        with pytest.raises(NoReplicaError, match="no live prefill replica"):
            await waiting
        with pytest.raises(NoReplicaError, match="no live prefill replica"):
            await router.acquire(req())
        assert_no_leaks(router)
    asyncio.run(main())


def test_a_replacement_that_does_not_serve_in_time_fails_its_waiters_by_name():
    async def main():
        router = make_router(1, 2, queue_timeout_s=0.1)
        router.mark_dead("d0", returning=True)
        router.mark_dead("d1", returning=True)
        with pytest.raises(NoReplicaError, match=r"no live decode replica \(d0, d1 are being replaced or "
                                                 r"recovering\), and none came back within 0.1s"):
            await router.acquire(req())
        router.mark_alive("d1")  # one back: a request past the others' capacity is busy again, not down
        held = [await router.acquire(req()) for _ in range(router.config.capacity(Stage.DECODE))]
        with pytest.raises(OverloadedError, match="no replica became free"):
            await router.acquire(req())
        for p in held:
            router.release(p)
        assert_no_leaks(router)
    asyncio.run(main())
