"""The backend's per-request loop (`RayBackend._deltas`, one placement of a
request): what it forwards to the client, what it tells the replicas, and
which failures it hands back for migration, for each event a request's
replicas can send. The replicas are scripted ends of real request channels
(they record the commands they get); the events are put in the request's
inbox in the order each test needs, as the channel server would."""
from __future__ import annotations

import asyncio
import queue

import pytest

from cluster.ray_backend import RayBackend, _ReplicaFailure
from cluster.router import Placement, Router, RouterConfig
from cluster.types import FinishReason, GenerateDelta, GenerateRequest
from engine.serving.channel import ChannelClient
from engine.serving.frames import Attach, FirstToken, Lost, PrefillDone, PrefillLost, Refused, TicketReady
from engine.serving.types import StageTimings

RID = "r1"
PLACEMENT = Placement(RID, "decode-0", "prefill-0")


class ScriptedReplica:
    def __init__(self, address: str, secret: bytes, replica_id: str):
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.client = ChannelClient(address, secret, replica_id, lambda ch, f: self.commands.put(f),
                                    lambda ch: None)

    def command(self, timeout_s: float = 5.0):
        return self.commands.get(timeout=timeout_s)


async def _run(script, timeline: bool = False, stall_timeout_s: float = 30.0):
    """Start a backend's channels with prefill-0 and decode-0 dialled in, run
    ``script(inbox, prefill, decode)`` beside the loop, return what the loop yielded."""
    backend = RayBackend("m", "disaggregated", None, 64, 100, Router(RouterConfig()), {},
                         stall_timeout_s=stall_timeout_s)
    channels = backend.channels
    await channels.start()
    run = asyncio.get_running_loop().run_in_executor
    prefill = await run(None, ScriptedReplica, channels.address, channels.secret, "prefill-0")
    decode = await run(None, ScriptedReplica, channels.address, channels.secret, "decode-0")
    await channels.wait_connected(["prefill-0", "decode-0"], 5)
    inbox = channels.open(RID, ["decode-0", "prefill-0"])
    request = GenerateRequest(RID, [1, 2, 3], timeline=timeline)
    out = []

    async def consume():
        try:
            async for d in backend._deltas(request, RID, inbox, PLACEMENT, 0.0):
                out.append(d)
        except _ReplicaFailure as f:
            out.append(f)
    task = asyncio.create_task(consume())
    loop = asyncio.get_running_loop()
    await run(None, script, lambda event: loop.call_soon_threadsafe(inbox.put_nowait, event), prefill, decode)
    await asyncio.wait_for(task, 10)
    channels.close(RID)
    await channels.stop()
    return out


def delta(tokens, text="", finish=None, **kw) -> GenerateDelta:
    return GenerateDelta(RID, list(tokens), text, finish, **kw)


def done(error=None) -> PrefillDone:
    return PrefillDone(RID, error, StageTimings(queued=1.0, first_scheduled=1.5, first_token=2.0,
                                                kv_transfer_time_s=0.25, kv_transfer_bytes=4096))


def test_each_token_is_forwarded_once_in_order_and_the_ticket_goes_to_prefill():
    def script(put, prefill, decode):
        put(TicketReady(RID, "the-ticket"))
        assert prefill.command() == Attach(RID, "the-ticket")
        put(FirstToken(delta([7], " Paris", num_cached_tokens=16)))
        put(delta([8], " is"))
        put(done())
        put(delta([9], ".", FinishReason.STOP))
    out = asyncio.run(_run(script))
    assert [(d.token_ids, d.text) for d in out] == [([7], " Paris"), ([8], " is"), ([9], ".")]
    assert out[-1].finish_reason is FinishReason.STOP and out[-1].num_cached_tokens == 16  # prefill's cache
    m = out[-1].stage_metrics
    assert (m.queue_time_s, m.prefill_time_s, m.kv_transfer_time_s, m.kv_transfer_bytes) == (0.5, 0.5, 0.25, 4096)


def test_a_decode_delta_that_overtakes_the_first_token_waits_for_it():
    def script(put, prefill, decode):
        put(delta([8], " is"))  # rode the decode socket, which was faster
        put(delta([9], "."))
        put(FirstToken(delta([7], " Paris")))
        put(delta([10], "", FinishReason.LENGTH))
    out = asyncio.run(_run(script))
    assert [d.token_ids for d in out] == [[7], [8], [9], [10]]


@pytest.mark.parametrize("events, cause, error", [
    ([done("KV transfer failed: receiver lost")], "kv_transfer_failed", "prefill failed: KV transfer failed"),
    ([Lost("prefill-0")], "prefill_lost", "prefill replica prefill-0 died before the first token"),
    ([FirstToken(delta([7], "a")), Lost("decode-0")], "decode_lost", "decode replica decode-0 died mid-stream"),
    ([FirstToken(delta([7], "a")), delta([], "", FinishReason.ERROR, error="KV transfer failed: lease expired")],
     "kv_transfer_failed", "KV transfer failed: lease expired"),
    ([FirstToken(delta([7], "a")), delta([], "", FinishReason.ERROR, error="decode-0 failed: loop died")],
     "replica_error", "decode-0 failed: loop died"),
], ids=["prefill-failed", "prefill-lost", "decode-lost", "decode-transfer-failed", "decode-error"])
def test_a_replica_failure_is_handed_back_for_migration_with_its_cause(events, cause, error):
    def script(put, prefill, decode):
        for e in events:
            put(e)
    out = asyncio.run(_run(script))
    failure = out[-1]
    assert isinstance(failure, _ReplicaFailure) and failure.cause == cause and failure.error.startswith(error)
    assert all(isinstance(d, GenerateDelta) and not d.is_finished for d in out[:-1])


def test_a_prefill_replica_lost_mid_transfer_tells_the_decode_replica_and_waits_for_it():
    """After the first token the decode replica may have the whole KV: it decides (`PrefillLost`)."""
    def script(put, prefill, decode):
        put(FirstToken(delta([7], "a")))
        put(Lost("prefill-0"))
        assert decode.command() == PrefillLost(RID, "prefill-0")
        put(delta([8], "b", FinishReason.LENGTH))  # it had landed: decode streams on
    out = asyncio.run(_run(script))
    assert [d.token_ids for d in out] == [[7], [8]] and out[-1].finish_reason is FinishReason.LENGTH
    assert out[-1].stage_metrics is None  # the prefill replica never reported


def test_a_prefill_replica_lost_after_its_transfer_ended_changes_nothing():
    def script(put, prefill, decode):
        put(FirstToken(delta([7], "a")))
        put(done())
        put(Lost("prefill-0"))
        put(TicketReady(RID, "late"))  # handled after the Lost: its Attach says the loop is past it
        assert prefill.command() == Attach(RID, "late")
        with pytest.raises(queue.Empty):  # nothing went to the decode replica
            decode.command(timeout_s=0.5)
        put(delta([8], "b", FinishReason.LENGTH))
    out = asyncio.run(_run(script))
    assert [d.token_ids for d in out] == [[7], [8]] and out[-1].finish_reason is FinishReason.LENGTH


def test_a_refusal_ends_the_request_with_its_error_and_is_not_migrated():
    def script(put, prefill, decode):
        put(Refused(RID, "prompt: too long"))
    out = asyncio.run(_run(script))
    assert [d.finish_reason for d in out] == [FinishReason.ERROR] and out[0].error == "prompt: too long"


def test_silence_past_the_stall_timeout_is_a_failure_of_the_replicas():
    out = asyncio.run(_run(lambda put, p, d: None, stall_timeout_s=0.2))
    assert isinstance(out[-1], _ReplicaFailure) and out[-1].cause == "stalled"


def test_a_timeline_waits_briefly_for_the_prefill_report():
    def script(put, prefill, decode):
        put(FirstToken(delta([7], "a")))
        put(delta([8], "b", FinishReason.LENGTH, timings=StageTimings(kv_ready=2.5, first_decode=2.6)))
        put(done())  # after the last token: the loop waits for it, since a timeline was asked for
    out = asyncio.run(_run(script, timeline=True))
    t = out[-1].timeline
    assert t.prefill_end_s is not None and t.kv_transfer_done_s is not None and out[-1].stage_metrics is not None
