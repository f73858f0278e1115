"""The stages served over their request channels (`engine.serving.channel`), as the
frontend drives them: a disaggregated request equals the offline engine's
and a colocated one too; a refused command names what is wrong; a channel
that breaks aborts what its requests hold on both stages."""
from __future__ import annotations

import asyncio
import time

import pytest

from decode.stage import DecodeStage
from engine.serving.channel import ChannelServer
from engine.serving.frames import Attach, FirstToken, Lost, Prefill, PrefillDone, Refused, Reserve, Submit, TicketReady
from engine.serving.types import GenerateDelta
from engine.config import EngineConfig
from engine.llm import LLM
from engine.sampling import SamplingParams
from engine.sequence import SequenceStatus
from kvtransfer.config import ReceiverConfig, SenderConfig
from prefill.stage import PrefillStage
from tests.engine.factories import random_prompts, save_tiny_model
from tests.stages.harness import wait_free as _wait_free

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
SECRET = b"k" * 32


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    save_tiny_model(d, "llama", max_position_embeddings=2048)
    return d


@pytest.fixture
def served(model_dir):
    """prefill-0, decode-0 and a colocated replica, each dialled into one frontend-side server."""
    cfg = EngineConfig(dtype="float32", num_kv_blocks=160, max_num_batched_tokens=64)
    stages = {
        "prefill-0": PrefillStage("prefill-0", str(model_dir), cfg, SenderConfig("s", lease_s=10, deadline_s=10)),
        "decode-0": DecodeStage("decode-0", str(model_dir), cfg, ReceiverConfig("s", "local", lease_s=10)),
        "colocated-0": DecodeStage("colocated-0", str(model_dir), cfg, None),
    }
    loop = asyncio.new_event_loop()
    server = ChannelServer(SECRET)
    loop.run_until_complete(server.start())

    async def connect():
        run = asyncio.get_running_loop().run_in_executor
        await asyncio.gather(*(run(None, s.connect_channel, server.address, SECRET) for s in stages.values()))
        await server.wait_connected(stages, 10)
    loop.run_until_complete(connect())
    yield loop, server, stages
    loop.run_until_complete(server.stop())
    loop.close()
    for s in stages.values():
        s.close()


async def _drive(server, rid, prompt, params, prefill="prefill-0", decode="decode-0", stop_after=None):
    """What the backend does for one request; returns (token ids, finish or error, events seen)."""
    replicas = [decode] + ([prefill] if prefill else [])
    inbox = server.open(rid, replicas)
    try:
        if prefill:
            server.send(prefill, Prefill(rid, prompt, params))
            server.send(decode, Reserve(rid, prompt, params))
        else:
            server.send(decode, Submit(rid, prompt, params))
        ids, kinds = [], []
        while True:
            event = await asyncio.wait_for(inbox.get(), 30)
            kinds.append(type(event))
            if isinstance(event, TicketReady):
                server.send(prefill, Attach(rid, event.ticket))
            elif isinstance(event, (Refused, Lost)):
                return ids, f"error: {event}", kinds
            elif isinstance(event, FirstToken):
                ids.extend(event.delta.token_ids)
            elif isinstance(event, GenerateDelta):
                ids.extend(event.token_ids)
                if event.is_finished:
                    if prefill and PrefillDone not in kinds:
                        # The prefill replica reports between its passes: its
                        # word may come after the decode replica's last token.
                        kinds.append(type(await asyncio.wait_for(inbox.get(), 30)))
                    return ids, event.finish_reason, kinds
                if stop_after is not None and len(ids) >= stop_after:
                    return ids, "stopped", kinds
    finally:
        server.close(rid)


def test_requests_over_the_channels_equal_the_engine(model_dir, served):
    loop, server, stages = served
    prompts = random_prompts(4, 96, [5, 40, 17, 33], seed=11)
    ref = LLM(str(model_dir), dtype="float32", num_kv_blocks=64).generate(prompts, GREEDY)

    async def main():
        dis = [_drive(server, f"d{i}", p, GREEDY) for i, p in enumerate(prompts)]
        col = [_drive(server, f"c{i}", p, GREEDY, prefill=None, decode="colocated-0") for i, p in enumerate(prompts)]
        return await asyncio.gather(*dis, *col)
    results = loop.run_until_complete(main())
    for i, (ids, finish, kinds) in enumerate(results):
        assert finish == "length" and ids == ref[i % 4].token_ids, (i, finish)
    for _, _, kinds in results[:4]:  # disaggregated: ticket, first token and prefill result came back too
        assert {TicketReady, FirstToken, PrefillDone} <= set(kinds)
    assert _wait_free(*stages.values())


def test_a_refused_command_names_what_is_wrong_and_holds_nothing(served):
    loop, server, stages = served
    p = random_prompts(1, 96, [20], seed=12)[0]

    async def main():
        too_long = await _drive(server, "long", p * 110, GREEDY, prefill=None, decode="colocated-0")
        reserve_on_colocated = await _drive(server, "r", p, GREEDY, prefill=None, decode="colocated-0")
        # a reservation sent where a whole request belongs
        inbox = server.open("x", ["colocated-0"])
        server.send("colocated-0", Reserve("x", p, GREEDY))
        wrong_stage = await asyncio.wait_for(inbox.get(), 10)
        server.close("x")
        inbox = server.open("y", ["prefill-0"])
        server.send("prefill-0", Submit("y", p, GREEDY))  # a whole request sent to a prefill replica
        unknown = await asyncio.wait_for(inbox.get(), 10)
        server.close("y")
        return too_long, reserve_on_colocated, wrong_stage, unknown
    too_long, ok, wrong_stage, unknown = loop.run_until_complete(main())
    assert too_long[1].startswith("error:") and "prompt" in too_long[1]
    assert ok[1] == "length"
    assert isinstance(wrong_stage, Refused) and "colocated" in wrong_stage.error
    assert unknown == Refused("y", "prefill-0 does not take Submit")
    assert _wait_free(*stages.values())


def test_a_duplicate_request_id_is_refused_and_the_first_goes_on(served):
    loop, server, stages = served
    p = random_prompts(1, 96, [20], seed=13)[0]

    async def main():
        inbox = server.open("dup", ["colocated-0"])
        server.send("colocated-0", Submit("dup", p, GREEDY))
        server.send("colocated-0", Submit("dup", p, GREEDY))
        ids, errors = [], []
        while True:
            event = await asyncio.wait_for(inbox.get(), 30)
            if isinstance(event, Refused):
                errors.append(event.error)
            elif event.token_ids or event.is_finished:
                ids.extend(event.token_ids)
                if event.is_finished:
                    server.close("dup")
                    return ids, errors
    ids, errors = loop.run_until_complete(main())
    assert len(ids) == GREEDY.max_tokens and errors == ["request_id: 'dup' is already running on colocated-0"]
    assert _wait_free(*stages.values())


def test_a_broken_channel_aborts_its_requests_on_both_stages(served):
    loop, server, stages = served
    p = random_prompts(1, 96, [40], seed=14)[0]
    long = SamplingParams(max_tokens=2000, temperature=0, ignore_eos=True)
    decode = stages["decode-0"]

    async def main():
        ids, how, _ = await _drive(server, "cut", p, long, stop_after=3)
        assert how == "stopped" and len(ids) >= 3
        seq = decode.call(lambda: decode.core.get("cut"))
        server.drop("decode-0")
        server.drop("prefill-0")
        return seq
    seq = loop.run_until_complete(main())
    deadline = time.monotonic() + 5
    while not seq.is_finished:
        assert time.monotonic() < deadline, "the request ran on after its channel broke"
        time.sleep(0.01)
    assert seq.status is SequenceStatus.FINISHED_ABORTED and len(seq.output_token_ids) < 1000
    assert _wait_free(*stages.values())
